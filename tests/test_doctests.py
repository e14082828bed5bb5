"""Every ``Examples:`` block in the library runs (``>>>`` lines are tests, not decoration)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import rbpipe


def _modules_with_examples() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(rbpipe.__path__, "rbpipe."):
        spec = importlib.util.find_spec(info.name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            with open(spec.origin, encoding="utf-8") as f:
                if ">>>" in f.read():
                    names.append(info.name)
    return names


MODULES = _modules_with_examples()


def test_the_library_has_examples():
    assert {"rbpipe.service.coordinator", "rbpipe.system.fsutil", "rbpipe.rate_limit",
            "rbpipe.storage.arrow"} <= set(MODULES)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the examples' tempfile.mkdtemp() go with the test
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} example(s) of {name} failed"
    assert result.attempted > 0
