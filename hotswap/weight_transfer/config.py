"""`WeightTransferConfig`: which backend an engine receives weights with, and its limits.

A leaf module (it imports no other hotswap module but the leaf `hotswap.errors`):
`hotswap.config` holds one, and the backends, the model layer under them, import
`hotswap.config`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

from hotswap.errors import InvalidArgument, nested

KV_POLICIES = ("keep", "recompute")
# The backend registry: name -> its engine class (a WeightTransferEngine), filled by
# `register_backend` (engine.py) as each backend module is imported. The built-in ones are
# imported by `hotswap.weight_transfer.backends`, which the package's facade imports with
# the engine (hotswap/__init__.py), so every config parsed sees them. Declared in this leaf
# so a config's backend is checked without a backend imported here.
ENGINE_BACKENDS: dict[str, type] = {}
BACKEND_NAMES = ENGINE_BACKENDS.keys()  # the names a config may choose


def check_backend_name(name: str) -> None:
    """InvalidArgument unless a backend is registered under `name`."""
    if name not in BACKEND_NAMES:
        choices = ", ".join(sorted(BACKEND_NAMES))
        raise InvalidArgument("backend", f"backend: unknown {name!r}; choose from {choices}")


def parse_config_object(value: str | dict[str, Any]) -> dict[str, Any]:
    """`--weight-transfer-config` JSON text (or a dict) as a dict; ValueError otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidArgument(
                "weight_transfer_config", f"weight_transfer_config: not valid JSON ({e})"
            ) from None
    if not isinstance(value, dict):
        raise InvalidArgument(
            "weight_transfer_config", "weight_transfer_config: must be a JSON object"
        )
    return value


@dataclass(frozen=True)
class WeightTransferConfig:
    backend: str = "gloo"
    # Refuse a round that does not write every weight of the model (off: partial updates,
    # e.g. only the trained layers, are allowed).
    require_complete: bool = False
    # A round with no call for this long (its trainer died or hangs between calls) is
    # aborted, and generation resumes. Idle time: a long receive does not count against it.
    round_timeout_s: float = 30.0
    # Master addresses a broadcast init may name (host names, addresses or networks such
    # as "10.0.0.0/8"); None: any. The engine connects to whatever a control caller names.
    allowed_master_addresses: tuple[str, ...] | None = None
    # Keep last round's receive buffers for the next (one extra copy of what was sent held
    # between rounds, on the engine's device; about 3x faster receives on CPU). Off:
    # allocate per round (on a GPU short of memory). Sleep (level >= 1) drops them.
    # The ipc backend stages views of the trainer's memory and uses no buffers.
    reuse_receive_buffers: bool = True
    # Generation keeps running on the committed weights while a round is open: chunks are
    # received and staged beside the steps, and `finish` switches weights between two
    # steps (issue 14). Off: no step runs from `start` to `finish`.
    in_flight: bool = False
    # What requests running across a commit do, unless the finish call says otherwise:
    # "keep" their KV (tokens after the switch are marked stale) or "recompute" it under
    # the new weights before their next token.
    kv_policy: str = "keep"
    # Keep a second copy of the weights that rounds are written into while steps read the
    # live one; the commit swaps the two (a pointer swap per tensor instead of a copy of
    # the model between two steps). Refused at start if the memory cannot hold the copy,
    # unless `allow_copy_fallback` (then the commit copies, as without it).
    double_buffer: bool = False
    allow_copy_fallback: bool = False

    def __post_init__(self) -> None:
        timeout = self.round_timeout_s
        if (
            not isinstance(timeout, (int, float))
            or isinstance(timeout, bool)
            or not (timeout > 0 and math.isfinite(timeout))
        ):
            raise InvalidArgument(
                "round_timeout_s", f"round_timeout_s: must be a positive number, got {timeout!r}"
            )
        for flag in ("require_complete", "reuse_receive_buffers", "in_flight", "double_buffer",
                     "allow_copy_fallback"):  # fmt: skip
            if not isinstance(getattr(self, flag), bool):
                raise InvalidArgument(flag, f"{flag}: must be a boolean")
        if self.kv_policy not in KV_POLICIES:
            raise InvalidArgument("kv_policy", f"kv_policy: must be one of "
                                  f"{', '.join(KV_POLICIES)}, got {self.kv_policy!r}")  # fmt: skip
        allowed = self.allowed_master_addresses
        if allowed is not None:
            if isinstance(allowed, str) or not all(isinstance(a, str) and a for a in allowed):
                raise InvalidArgument(
                    "allowed_master_addresses",
                    "allowed_master_addresses: must be a list of host names, addresses or networks",
                )
            object.__setattr__(self, "allowed_master_addresses", tuple(allowed))

    @classmethod
    def parse(
        cls, value: str | dict[str, Any] | WeightTransferConfig | None
    ) -> WeightTransferConfig | None:
        """From `--weight-transfer-config` JSON, a dict, or an instance; None stays None."""
        if value is None or isinstance(value, WeightTransferConfig):
            return value
        value = parse_config_object(value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidArgument(
                "weight_transfer_config", f"weight_transfer_config: unknown key(s) {unknown}"
            )
        with nested("weight_transfer_config"):  # its keys, e.g. weight_transfer_config.backend
            config = cls(**value)
            check_backend_name(config.backend)
        return config
