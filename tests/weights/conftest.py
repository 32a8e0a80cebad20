"""The weight-transfer tests' models and trainers, for the engine's own weight tests."""

from tests.weight_transfer.conftest import (  # noqa: F401 - fixtures
    v1_trainer,
    v2_trainer,
)
