import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # The test machine is shared: keep torch to one thread.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
