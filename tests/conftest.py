import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Deterministic, bounded property tests: the suite must stay fast on 2 cores and reproducible in CI.
settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _one_thread():
    """Every model in the suite is tiny: one intra-op thread is much faster than several fighting over the
    2 shared cores of the CI machine (measured 10-40x). Restored after each test."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
