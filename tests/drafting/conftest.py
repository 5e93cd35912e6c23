"""The drafters' tests use the decoding tests' tiny float64 models (tests/decode/conftest.py)."""

from tests.decode.conftest import _one_thread, prompts, target_factory, tiny  # noqa: F401  (fixtures)
