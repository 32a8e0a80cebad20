"""The backend registries: the names a config accepts are the backends that exist."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hotswap.weight_transfer.backends import WeightTransferTrainerFactory, get_backend
from hotswap.weight_transfer.config import BACKEND_NAMES, WeightTransferConfig
from hotswap.weight_transfer.engine import ENGINE_BACKENDS
from hotswap.weight_transfer.trainer import TRAINER_BACKENDS


def test_config_names_match_registered_backends() -> None:
    # `WeightTransferConfig.parse` checks names without importing the backends.
    assert BACKEND_NAMES == set(ENGINE_BACKENDS) == set(TRAINER_BACKENDS)


def _parse(name: str) -> object:
    return WeightTransferConfig.parse({"backend": name})


@pytest.mark.parametrize("lookup", [get_backend, _parse])
def test_unknown_backend_refused(lookup: Callable[[str], object]) -> None:
    with pytest.raises(ValueError, match=r"unknown 'carrier-pigeon'; choose from disk, gloo, ipc"):
        lookup("carrier-pigeon")


def test_trainer_factory_refuses_unknown_backend() -> None:
    class Info:
        backend = "carrier-pigeon"

    with pytest.raises(ValueError, match="no trainer engine for backend 'carrier-pigeon'"):
        WeightTransferTrainerFactory.trainer_init(Info(), None, None)  # type: ignore[arg-type]
