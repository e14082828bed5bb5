"""The one table of engines (``rbpipe.service.engine.ENGINES``): each ``--engine`` name opens its service class
and its worker site, and an unknown name is refused in one line by both."""

from __future__ import annotations

import pytest

from rbpipe.config import RunConfig
from rbpipe.errors import ConfigError
from rbpipe.service.engine import ENGINES, LocalEngine, RayEngine, open_engine
from rbpipe.workers.sites import LocalSite, RaySite, open_site


def test_every_engine_opens_its_service_and_its_site():
    assert list(ENGINES) == ["local", "ray"]
    assert type(open_engine("local")) is LocalEngine and type(open_engine("ray")) is RayEngine
    assert type(open_site("local", RunConfig())) is LocalSite
    site = open_site("ray", RunConfig(), {"grouping_shards": 2})
    assert type(site) is RaySite and site.summary_fields() == {"grouping_shards": 2}
    for name in ENGINES:
        assert open_engine(name).kind == name


@pytest.mark.parametrize("opener", [open_engine, lambda name: open_site(name, RunConfig())], ids=["engine", "site"])
def test_an_unknown_engine_is_refused_in_one_line(opener):
    with pytest.raises(ConfigError) as err:
        opener("spark")
    assert str(err.value) == "--engine must be one of local, ray, got 'spark'"
