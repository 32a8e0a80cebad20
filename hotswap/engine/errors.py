"""Errors the engine raises to its callers (Python API and HTTP alike)."""

from __future__ import annotations

from hotswap.errors import InvalidArgument

__all__ = ["EngineDeadError", "EngineStateError", "InvalidArgument"]


class EngineDeadError(RuntimeError):
    """The engine core stopped; every pending stream and call fails with this."""


class EngineStateError(RuntimeError):
    """The engine refused a call its current state does not allow (HTTP 409), e.g. waking
    the scheduler while the weights still sleep. Nothing was changed."""
