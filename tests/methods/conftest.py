import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """The models here are tiny: one intra-op thread is much faster than several fighting over 2 shared
    cores (measured 20x on the CI-sized machine). Restored after each test."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
