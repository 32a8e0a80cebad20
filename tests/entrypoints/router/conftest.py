# The trainer model of the weight-transfer tests (v1_dir and v2_dir: tests/conftest.py).
from tests.weight_transfer.conftest import v2_trainer  # noqa: F401
