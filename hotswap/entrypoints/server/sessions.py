"""What the dialects remember between calls, in one typed place per app.

A framework's weight plane is a conversation: join a group, send updates naming it,
destroy it. SGLang, AReaL, TRL and PipelineRL each keep such a `GroupSession`, with one
lifecycle for all:

    created --join--> joined --close--> closed --join--> joined ...
                        any --fail--> failed --join--> joined ...

Only a joined session accepts updates for its group; a session fails when a call broke
its channel, so the next call must be a new join. Each session's `lock` serialises its
dialect's weight calls in arrival order; every join goes through group_join.py. vLLM's
weight checker keeps its baseline here too.
The app creates its `DialectSessions` once (app.py), so every route of a dialect
sees the same session, and two apps in one process never share one.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

if TYPE_CHECKING:
    from torch import nn


class GroupPhase(enum.Enum):
    CREATED = "created"  # no group joined since the server started
    JOINED = "joined"  # an init succeeded: updates may name this group
    CLOSED = "closed"  # the trainer destroyed or closed the group
    FAILED = "failed"  # a call broke the channel: a new init must come first


@dataclass
class GroupSession:
    """The trainer's group as one dialect joined it (see the module docstring)."""

    phase: GroupPhase = GroupPhase.CREATED
    group_name: str | None = None  # the joined group's name (None unless joined)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def is_joined(self) -> bool:
        return self.phase is GroupPhase.JOINED

    def join(self, group_name: str | None = None) -> None:
        """Enter a group (TRL's communicator has no name); whatever the old one left
        behind is forgotten."""
        self._leave(GroupPhase.JOINED)
        self.group_name = group_name

    def close(self) -> None:
        self._leave(GroupPhase.CLOSED)

    def fail(self) -> None:
        self._leave(GroupPhase.FAILED)

    def _leave(self, phase: GroupPhase) -> None:
        """Forget everything the old group left behind, then enter `phase`."""
        self.phase, self.group_name = phase, None


@dataclass
class ArealSession(GroupSession):
    # The meta `/areal_set_update_weight_meta` set for the next update: one update per
    # meta, and never one of a group left since.
    meta: dict[str, list] | None = None

    def _leave(self, phase: GroupPhase) -> None:
        super()._leave(phase)
        self.meta = None


@dataclass
class PendingWork:
    """TRL's work running behind an answer: an init waiting for the trainer, or one
    parameter's receive and commit."""

    task: asyncio.Task[Any]
    what: str
    is_init: bool


@dataclass
class TRLSession(GroupSession):
    pending: PendingWork | None = None  # settled by the next call
    # The served model's class on the meta device (names and shapes, no memory), built
    # on the first update: the checkpoint view TRL's parameter names map onto.
    model: nn.Module | None = field(default=None, repr=False)


@dataclass
class WeightChecker:
    """vLLM's weight checker: the checksums a later check compares against."""

    baseline: dict[str, str] | None = None


@dataclass
class DialectSessions:
    sglang: GroupSession = field(default_factory=GroupSession)
    areal: ArealSession = field(default_factory=ArealSession)
    trl: TRLSession = field(default_factory=TRLSession)
    pipelinerl: GroupSession = field(default_factory=GroupSession)
    weight_checker: WeightChecker = field(default_factory=WeightChecker)


def dialect_sessions(request: Request) -> DialectSessions:
    """The app's sessions (made with the app: hotswap/entrypoints/server/app.py)."""
    return request.app.state.dialect_sessions
