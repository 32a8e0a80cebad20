# The V1 / V2 tiny checkpoints and trainer models of the weight-transfer tests.
from tests.weight_transfer.conftest import v1_dir, v2_dir, v2_trainer  # noqa: F401
