"""EngineGroup's failure paths, against recording fake engines: whatever fails, no engine
is left with an open round (it would stop generating) and the error says where."""

from __future__ import annotations

from typing import Any

import pytest

from hotswap.rl import EngineGroup, EngineGroupError, GroupCommittedWeights
from hotswap.weight_transfer import CommittedWeights, WeightSyncError


class FakeEngine:
    def __init__(self, fail: str = "", label: str = "v0", digest: str | None = "d0") -> None:
        self.fail, self.round_open, self.calls = fail, False, []
        self.info = {"weight_version": label, "version": 0, "digest": digest}

    def _step(self, phase: str) -> None:
        self.calls.append(phase)
        if phase == self.fail:
            raise WeightSyncError(f"{phase} refused")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", init_info.get("rank_offset")))

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self.round_open = True  # opened, even if the reply is then lost
        self._step("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._step("update")

    def prepare_weight_update(self) -> None:
        self._step("prepare")

    def finish_weight_update(
        self, weight_version: str | None = None, abort: bool = False, **kw: bool
    ) -> CommittedWeights | None:
        if abort:
            self.round_open = False
            self.calls.append("abort")
            return None
        self._step("finish")
        self.round_open = False
        version = self.info["version"] + 1
        self.info = {**self.info, "weight_version": weight_version, "version": version}
        return CommittedWeights(version, weight_version, self.info["digest"] if kw else None)

    def get_world_size(self) -> int:
        return 2

    def weight_info(self) -> dict[str, Any]:
        return self.info


def round_(group: EngineGroup, label: str | None = "v1") -> GroupCommittedWeights | None:
    group.start_weight_update()
    group.update_weights({})
    return group.finish_weight_update(label)


class PlainEngine(FakeEngine):
    """A client of the plain protocol: no `digest` flag, reports nothing."""

    def finish_weight_update(self, weight_version: str | None = None, abort: bool = False) -> None:
        super().finish_weight_update(weight_version, abort)


def test_the_commit_returns_every_engines_answer() -> None:
    engines = [FakeEngine(), FakeEngine()]
    group = EngineGroup(engines, world_sizes=[1, 1])
    assert round_(group) == GroupCommittedWeights(
        "v1", (CommittedWeights(1, "v1"), CommittedWeights(1, "v1"))
    )
    engines[1].info["version"] = 5  # e.g. restarted and committed on its own since
    group.start_weight_update()
    committed = group.finish_weight_update("v2", digest=True)
    assert committed.engines == (CommittedWeights(2, "v2", "d0"), CommittedWeights(6, "v2", "d0"))
    assert (committed.label, committed.version, committed.digest) == ("v2", None, "d0")
    assert group.finish_weight_update(abort=True) is None


def test_a_client_that_reports_nothing_still_commits() -> None:
    engines = [FakeEngine(digest="d1"), PlainEngine()]
    group = EngineGroup(engines, world_sizes=[1, 1])
    committed = round_(group)
    assert committed.engines == (CommittedWeights(1, "v1"), None)
    assert (committed.label, committed.version, committed.digest) == ("v1", None, None)
    assert all(e.info["weight_version"] == "v1" for e in engines)


def test_broadcast_ranks_follow_each_engines_workers() -> None:
    engines = [FakeEngine(), FakeEngine()]
    group = EngineGroup(engines)
    assert group.num_workers == 4
    group.init_weight_transfer_engine({"world_size": 5})  # no offset given: starts at 1
    assert [e.calls[0] for e in engines] == [("init", 1), ("init", 3)]
    with pytest.raises(ValueError, match="world_size must be 5"):
        group.init_weight_transfer_engine({"world_size": 3})


@pytest.mark.parametrize("phase", ["start", "prepare"])
def test_a_refusal_leaves_no_round_open_anywhere(phase: str) -> None:
    engines = [FakeEngine(), FakeEngine(fail=phase)]
    group = EngineGroup(engines, world_sizes=[1, 1])
    with pytest.raises(EngineGroupError, match=rf"engine 1 \(#1\): {phase} refused"):
        round_(group)
    assert not any(e.round_open for e in engines)
    assert all("finish" not in e.calls for e in engines)  # nothing committed


def test_a_bad_label_is_refused_before_anything_commits() -> None:
    engines = [FakeEngine(), FakeEngine()]
    group = EngineGroup(engines, world_sizes=[1, 1])
    with pytest.raises(ValueError, match="weight_version: must be a non-empty string"):
        round_(group, "")
    assert not any(e.round_open for e in engines)


def test_a_commit_failing_after_prepare_names_where_it_landed() -> None:
    engines = [FakeEngine(), FakeEngine(fail="finish")]
    group = EngineGroup(engines, world_sizes=[1, 1])
    with pytest.raises(EngineGroupError, match=r"committed on \['#0'\]"):
        round_(group)
    assert not any(e.round_open for e in engines)


def test_consistency_needs_equal_labels_and_real_digests() -> None:
    same = EngineGroup([FakeEngine(), FakeEngine()], world_sizes=[1, 1])
    assert same.check_consistent() == {"weight_version": "v0", "digest": "d0"}
    in_process = FakeEngine()
    in_process.info = {"label": "other", "version": 0, "digest": "d0"}  # LLM's shape
    with pytest.raises(WeightSyncError, match="disagree"):
        EngineGroup([FakeEngine(), in_process], world_sizes=[1, 1]).check_consistent()
    unknown = [FakeEngine(digest=None), FakeEngine(digest=None)]
    with pytest.raises(WeightSyncError, match="disagree"):
        EngineGroup(unknown, world_sizes=[1, 1]).check_consistent()
