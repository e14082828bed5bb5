import pytest
from tensordict import set_list_to_stack


@pytest.fixture(autouse=True)
def list_to_stack():
    """torchrl's LLM stack needs lists stacked (``set_list_to_stack``), as its recipe sets at start."""
    with set_list_to_stack(True):
        yield
