import pytest


@pytest.fixture(scope="session")
def grouping_manager():
    from rbpipe.grouping import start_manager

    manager = start_manager()
    yield manager
    manager.shutdown()
