import os

from hypothesis import HealthCheck, settings

# Deterministic, bounded property tests: the suite must stay fast on 2 cores and reproducible in CI.
settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
