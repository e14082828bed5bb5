import pytest


@pytest.fixture(scope="session")
def grouping_manager():
    from rbpipe.grouping import start_manager

    manager = start_manager()
    yield manager
    manager.shutdown()


@pytest.fixture
def short_lease_manager(request, monkeypatch):
    """A manager of its own whose leases live the test module's ``TTL`` seconds without a renewal."""
    from tests.grouping.helpers import lease_manager

    with lease_manager(monkeypatch, request.module.TTL) as manager:
        yield manager
