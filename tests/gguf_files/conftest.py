"""The GGUF tests: one torch thread per test module (tests/models/conftest.py says why)."""

from tests.models.conftest import _one_torch_thread  # noqa: F401  (an autouse fixture)
