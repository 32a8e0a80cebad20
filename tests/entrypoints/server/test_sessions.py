"""The dialects' weight-plane sessions: one lifecycle, one typed place per app."""

from __future__ import annotations

import asyncio
from pathlib import Path

from hotswap.entrypoints.server import sessions
from hotswap.entrypoints.server.sessions import (
    ArealSession,
    DialectSessions,
    GroupPhase,
    GroupSession,
    TRLSession,
)

ENTRYPOINTS = Path(sessions.__file__).parents[1]
FRAMEWORKS = ("vllm", "sglang", "trl", "prime_rl", "pipelinerl", "areal")  # their dialects


def test_lifecycle_created_joined_closed_failed() -> None:
    session = GroupSession()
    assert session.phase is GroupPhase.CREATED and not session.is_joined
    session.join("g1")
    assert session.is_joined and session.group_name == "g1"
    session.close()
    assert session.phase is GroupPhase.CLOSED and session.group_name is None
    session.join("g2")
    session.fail()
    assert session.phase is GroupPhase.FAILED and not session.is_joined
    assert session.group_name is None  # a failed group is never named again
    session.join("g3")
    assert session.is_joined and session.group_name == "g3"


def test_leaving_forgets_what_the_old_group_left_behind() -> None:
    areal = ArealSession()
    areal.join("g")
    areal.meta = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]]}
    areal.close()
    assert areal.meta is None  # no update may use a meta set for the group left
    areal.join("g")
    areal.meta = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]]}
    areal.join("h")  # a new init replaces the group: its meta goes too
    assert areal.meta is None
    trl = TRLSession()
    trl.join()  # TRL's communicator has no name
    assert trl.is_joined and trl.group_name is None


def test_each_app_gets_its_own_sessions_and_locks() -> None:
    first, second = DialectSessions(), DialectSessions()
    first.sglang.join("g")
    assert not second.sglang.is_joined
    assert first.trl.lock is not second.trl.lock
    assert len({id(s.lock) for s in (first.sglang, first.areal, first.trl, first.pipelinerl)}) == 4

    async def serialised() -> list[str]:
        order: list[str] = []

        async def call(name: str) -> None:
            async with first.pipelinerl.lock:
                order.append(name + ":in")
                await asyncio.sleep(0)
                order.append(name + ":out")

        await asyncio.gather(call("a"), call("b"))
        return order

    assert asyncio.run(serialised()) == ["a:in", "a:out", "b:in", "b:out"]


def test_no_dialect_keeps_state_on_the_app_by_hand() -> None:
    """Dialect state lives in DialectSessions: no dialect module reads or writes
    app.state attributes of its own (state.py's engine/config/metrics accessors aside)."""
    offenders = [path.name for name in FRAMEWORKS for path in (ENTRYPOINTS / name).glob("*.py")
                 if "app.state" in path.read_text()]  # fmt: skip
    assert offenders == []
