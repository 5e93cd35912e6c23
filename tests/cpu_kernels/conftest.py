"""The kernel tests: one torch thread per test module (tests/models/conftest.py says why), and the
decoding tests' tiny float64 models where a test decodes (tests/decode/conftest.py)."""

from tests.decode.conftest import prompts, target_factory, tiny  # noqa: F401  (fixtures)
from tests.models.conftest import _one_torch_thread  # noqa: F401  (an autouse fixture)
