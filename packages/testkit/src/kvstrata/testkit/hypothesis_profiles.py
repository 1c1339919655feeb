"""Hypothesis profiles shared by every member's tests.

`ci` (the default) keeps the whole suite within a few minutes on a 2-core machine; `thorough`
runs ten times the examples for a local soak (`HYPOTHESIS_PROFILE=thorough uv run pytest`).
Deadlines are off: the machine is shared and noisy, and a test never asserts wall-clock time.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def register_profiles() -> None:
    common = {
        "deadline": None,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    }
    settings.register_profile("ci", max_examples=60, stateful_step_count=40, **common)
    settings.register_profile("thorough", max_examples=600, stateful_step_count=100, **common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
