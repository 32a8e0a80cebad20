"""One trainer, several rollout engines, one commit point (docs/design.md §5).

`EngineGroup(clients)` is itself a weight-sync client: give it to
`WeightTransferTrainerFactory.trainer_init(...)` and one `send_weights()` updates every
engine. Each phase runs on all engines at once (a broadcast needs every receiver in it
together), and broadcast ranks are handed out in order: engine i's workers start right
after the workers of the engines before it.

The commit is two-phase. After the last chunk every engine *prepares* (refuses now what its
commit would refuse, e.g. an incomplete round under `require_complete`; applies nothing);
only if all of them agree does every engine *commit*. Otherwise every engine aborts its
round and keeps serving its previous weights, so the engines never disagree on a version
because one of them refused."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hotswap.engine.verb_methods import takes_verb_arguments
from hotswap.engine.verbs import (
    Args,
    FinishWeightUpdate,
    InitWeightTransfer,
    PrepareWeightUpdate,
    StartWeightUpdate,
    UpdateWeights,
    verb_name,
)
from hotswap.errors import InvalidArgument
from hotswap.weight_transfer.clients import (
    CommittedWeights,
    GroupCommittedWeights,
    PreparingWeightSyncClient,
    WeightSyncError,
    adapter_round,
)
from hotswap.weight_transfer.config import KV_POLICIES
from hotswap.weight_transfer.engine import shift_rank_offset


class EngineGroupError(WeightSyncError):
    """A phase (a verb) failed on some engines; `failed` maps engine index -> its error;
    `note` says what that left behind."""

    def __init__(self, phase: type[Args], failed: dict[int, BaseException], names: list[str],
                 note: str | None = None) -> None:  # fmt: skip
        details = "; ".join(f"engine {i} ({names[i]}): {e}" for i, e in failed.items())
        what = verb_name(phase) + (f" ({note})" if note else "")
        super().__init__(f"{what} failed on {len(failed)} of {len(names)} engines: {details}")
        self.failed = failed


class EngineGroup:
    def __init__(
        self,
        clients: Sequence[PreparingWeightSyncClient],
        world_sizes: Sequence[int] | None = None,
    ) -> None:
        """`world_sizes`: receiving workers per engine (asked of each engine if omitted)."""
        if not clients:
            raise ValueError("EngineGroup: needs at least one engine client")
        self.clients = list(clients)
        self.names = [_describe(c, i) for i, c in enumerate(self.clients)]
        sizes = list(world_sizes) if world_sizes is not None else [
            c.get_world_size() for c in self.clients
        ]  # fmt: skip
        if len(sizes) != len(self.clients) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes
        ):
            raise ValueError("world_sizes: one positive integer per engine client")
        self.world_sizes = sizes
        self._executor = ThreadPoolExecutor(len(self.clients), "hotswap-engine-group")

    @property
    def num_workers(self) -> int:
        """Receiving workers in all engines: a broadcast group is this + 1 (the trainer)."""
        return sum(self.world_sizes)

    # -- the weight-sync client protocol: the verbs' arguments (verb_methods.py) ------------
    @takes_verb_arguments(InitWeightTransfer)
    def init_weight_transfer_engine(self, *, init_info: dict[str, Any]) -> None:
        expected = 1 + self.num_workers
        if "world_size" in init_info and init_info["world_size"] != expected:
            raise ValueError(
                f"init_info.world_size: {init_info['world_size']}, but the group has "
                f"{self.num_workers} receiving worker(s): the trainer's world_size must be "
                f"{expected}"
            )
        infos = self._with_rank_offsets(init_info)
        failed = self._on_all(lambda c, i: c.init_weight_transfer_engine(infos[i]))
        if failed:
            raise EngineGroupError(InitWeightTransfer, failed, self.names)

    @takes_verb_arguments(StartWeightUpdate)
    def start_weight_update(
        self, *, is_checkpoint_format: bool, lora_name: str | None, lora_config: dict | None
    ) -> None:
        adapter = adapter_round(lora_name, lora_config)
        failed = self._on_all(lambda c, i: c.start_weight_update(is_checkpoint_format, **adapter))
        if failed:  # abort everywhere: a lost reply may hide a round that did open
            self._abort(range(len(self.clients)))
            raise EngineGroupError(StartWeightUpdate, failed, self.names)

    @takes_verb_arguments(UpdateWeights)
    def update_weights(self, *, update_info: dict[str, Any]) -> None:
        failed = self._on_all(lambda c, i: c.update_weights(update_info))
        if failed:
            raise EngineGroupError(UpdateWeights, failed, self.names)

    @takes_verb_arguments(FinishWeightUpdate)
    def finish_weight_update(
        self, *, weight_version: str | None, abort: bool, **options: Any
    ) -> GroupCommittedWeights | None:
        """Two-phase commit (see the module docstring); returns every engine's answer, or
        None for an abort. `digest=True` asks each engine for its weights' digest,
        `checksum=True` for its per-tensor checksums; `kv_policy` is the round's policy on
        every engine."""
        everyone = range(len(self.clients))
        if abort:
            self._abort(everyone)
            return None
        bad_label = not isinstance(weight_version, str) or not weight_version
        if weight_version is not None and bad_label:
            self._abort(everyone)
            raise ValueError(f"weight_version: must be a non-empty string, got {weight_version!r}")
        kv_policy = options["kv_policy"]
        if kv_policy is not None and kv_policy not in KV_POLICIES:
            self._abort(everyone)
            raise InvalidArgument("kv_policy", f"kv_policy: must be one of "
                                  f"{', '.join(KV_POLICIES)}, got {kv_policy!r}")  # fmt: skip
        failed = self._on_all(lambda c, i: c.prepare_weight_update())
        if failed:
            self._abort(everyone)
            raise EngineGroupError(PrepareWeightUpdate, failed, self.names,
                                   "nothing was committed")  # fmt: skip
        answers: dict[int, Any] = {}
        # Only the options asked for: a plain client takes none of them.
        options = {k: v for k, v in options.items() if v is not None and v is not False}

        def commit(client: PreparingWeightSyncClient, i: int) -> None:
            answers[i] = client.finish_weight_update(weight_version, **options)  # type: ignore[call-arg]

        failed = self._on_all(commit)
        if failed:  # not expected after prepare; say exactly where the commit landed
            self._abort(failed)
            committed = [self.names[i] for i in everyone if i not in failed]
            raise EngineGroupError(FinishWeightUpdate, failed, self.names,
                                   f"committed on {committed or 'none'}")  # fmt: skip
        engines = tuple(_committed(answers[i]) for i in everyone)
        labels = {e.label for e in engines if e is not None}
        return GroupCommittedWeights(labels.pop() if len(labels) == 1 else weight_version, engines)

    # -- checks -----------------------------------------------------------------------------
    def weight_infos(self) -> list[dict[str, Any]]:
        return [c.weight_info() for c in self.clients]

    def check_consistent(self) -> dict[str, Any]:
        """The engines' common {weight_version, digest}; WeightSyncError if they differ or
        an engine cannot vouch for its weights (no digest: asleep, missing, or DP ranks that
        disagree)."""
        seen = [(_label(info), info.get("digest")) for info in self.weight_infos()]
        if len(set(seen)) != 1 or seen[0][1] is None:
            listed = "; ".join(f"{name}: {label} {digest}"
                               for name, (label, digest) in zip(self.names, seen))  # fmt: skip
            raise WeightSyncError(f"engines disagree on their weights: {listed}")
        return {"weight_version": seen[0][0], "digest": seen[0][1]}

    def close(self) -> None:
        self._executor.shutdown(wait=False)

    # -- fan-out ----------------------------------------------------------------------------
    def _on_all(
        self,
        call: Callable[[PreparingWeightSyncClient, int], object],
        among: Iterable[int] | None = None,
    ) -> dict[int, BaseException]:
        """Run `call` on every engine (or `among`) at once; the failures by engine."""
        indices = range(len(self.clients)) if among is None else among
        futures = {i: self._executor.submit(call, self.clients[i], i) for i in indices}
        return {i: f.exception() for i, f in futures.items() if f.exception() is not None}

    def _abort(self, indices: Iterable[int]) -> None:
        """Best effort: an engine that cannot abort (e.g. has no open round) is skipped."""
        self._on_all(lambda c, i: c.finish_weight_update(abort=True), among=indices)

    def _with_rank_offsets(self, init_info: dict[str, Any]) -> list[dict[str, Any]]:
        """Each engine's workers follow those of the engines before it."""
        before = [sum(self.world_sizes[:i]) for i in range(len(self.world_sizes))]
        return [shift_rank_offset(init_info, shift) for shift in before]


def _committed(answer: object) -> CommittedWeights | None:
    """An engine's answer to the commit, whichever shape its client gave it in."""
    if answer is None or isinstance(answer, CommittedWeights):
        return answer
    if isinstance(answer, dict):
        return CommittedWeights.from_answer(answer)
    return None


def _label(info: dict[str, Any]) -> object:
    """The committed label, whichever client shape (HTTP or in-process) reported it."""
    return info.get("weight_version", info.get("label"))


def _describe(client: object, index: int) -> str:
    http = getattr(client, "http", None)
    return str(getattr(http, "base_url", "")) or f"#{index}"
