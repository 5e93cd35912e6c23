"""Shared test setup: hypothesis profiles and the session-wide reference solver."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

_HERE = os.path.dirname(os.path.abspath(__file__))
# This worktree's src/ first so the editable install of another checkout is never the one
# under test.  tests/ itself is never put on sys.path: it is the package ``tests`` (pytest
# puts the repository root on the path for it), so test helpers are imported as
# ``tests.oracles.reference`` and can never shadow a standard-library or third-party module
# (tests/test_layout.py checks that).
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "src"))

settings.register_profile(
    "default",
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,  # reproducible CI; run with --hypothesis-profile=explore for fresh seeds
)
settings.register_profile(
    "explore",
    deadline=None,
    max_examples=2000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def ref():
    """One cvxpy reference solver per session: per-(p, y) solutions are reused by every criterion."""
    from tests.oracles import reference  # deferred: loads cvxpy only when a test asks for it

    return reference.ReferenceSolver()
