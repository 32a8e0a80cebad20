"""Trainer side: `WeightTransferTrainerFactory.trainer_init(init_info, client=, source=)`
(in `backends`) builds an engine once; `send_weights()` per round drives start ->
update(s) -> finish on the serving engine and moves the bytes on the data plane at the same
time.

Every trainer rank calls `send_weights()` (iterating a source may itself be collective,
e.g. gathering shards); only rank 0 talks to the engine and sends."""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from hotswap.weight_transfer.base import ParamMeta, WeightSource, checked_items
from hotswap.weight_transfer.clients import Committed, WeightSyncClient, adapter_round

T = TypeVar("T")


@dataclass(kw_only=True)
class TrainerInitInfo:
    backend: ClassVar[str]
    rank: int = 0  # this trainer process's rank; rank 0 sends


class TrainerWeightTransferEngine(ABC):
    is_checkpoint_format: ClassVar[bool] = True

    def __init__(self, info: TrainerInitInfo, client: WeightSyncClient, source: WeightSource):
        self.info, self.client, self.source = info, client, source

    @property
    def is_sender(self) -> bool:
        return self.info.rank == 0

    @abstractmethod
    def connect(self) -> None:
        """Rank 0: set up the channel with the engine (init_weight_transfer_engine)."""

    @abstractmethod
    def send_round(self, metas: list[ParamMeta], tensors: list[torch.Tensor]) -> None:
        """Rank 0: the update call(s) and the data plane of one round."""

    def send_weights(
        self,
        weight_version: str | None = None,
        *,
        digest: bool = False,
        kv_policy: str | None = None,
        lora_name: str | None = None,
        lora_config: dict[str, Any] | None = None,
    ) -> Committed | None:
        """One full round (with `lora_name`: into that LoRA adapter, the source holding its
        PEFT tensors; `lora_config` declares a new one, see hotswap.rl.lora); returns what
        the engine committed: `CommittedWeights(version,
        label, digest)` (the digest only with `digest=True`: the engine then hashes its new
        weights, ~0.3 s for the default model), a `GroupCommittedWeights` for an
        `EngineGroup`, None on ranks other than 0. `kv_policy` ("keep" or "recompute")
        chooses, for this round, what requests running across the switch do with their KV
        (default: the engine's configured policy).
        The source is checked against its metadata before anything is sent; if the round
        fails after start, it is aborted on the engine (best effort), which keeps serving
        its previous weights."""
        metas, tensors = checked_items(self.source)
        if not self.is_sender:
            return None
        adapter = adapter_round(lora_name, lora_config)
        return self.run_round(
            lambda: self.send_round(metas, tensors), weight_version, digest, kv_policy, adapter
        )

    def run_round(
        self,
        move: Callable[[], None],
        weight_version: str | None,
        digest: bool = False,
        kv_policy: str | None = None,
        adapter: dict[str, Any] | None = None,
    ) -> Committed | None:
        """start -> `move` (the update calls and the data plane) -> finish; a round that
        fails after start is aborted on the engine (best effort). Returns the client's
        answer to the commit (None from a client that reports nothing). `adapter`: the
        start's lora_name and lora_config, for a round into a LoRA adapter."""
        self.client.start_weight_update(  # type: ignore[call-arg]
            is_checkpoint_format=self.is_checkpoint_format, **(adapter or {})
        )
        try:
            move()
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.finish_weight_update(abort=True)
            raise
        # Only the options asked for: a client of the plain protocol need not take them.
        options = commit_options(digest, kv_policy)
        return self.client.finish_weight_update(weight_version, **options)  # type: ignore[call-arg]

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release the channel."""


def commit_options(digest: bool, kv_policy: str | None) -> dict[str, Any]:
    """The commit's optional arguments that were asked for."""
    options: dict[str, Any] = {"digest": True} if digest else {}
    if kv_policy is not None:
        options["kv_policy"] = kv_policy
    return options


# backend name -> its trainer engine class, filled by `register_trainer` as each backend
# module is imported; `WeightTransferTrainerFactory` (in `backends`) imports the built-in ones.
TRAINER_BACKENDS: dict[str, type[TrainerWeightTransferEngine]] = {}


def register_trainer(backend: str) -> Callable[[type], type]:
    """Class decorator: the trainer engine for `backend`."""

    def add(engine_cls: type[TrainerWeightTransferEngine]) -> type:
        TRAINER_BACKENDS[backend] = engine_cls
        return engine_cls

    return add


def run_alongside(control: Callable[[], Any], data_plane: Callable[[], T]) -> T:
    """Run the engine-side `control` call and the data plane at once (both sides of a
    collective must be in it together). If the engine refuses, its reason is raised — at
    once, rather than after the data plane times out waiting for a peer that never comes
    (the channel is then unusable until set up again)."""
    control_errors: list[BaseException] = []
    data: dict[str, Any] = {}

    def call() -> None:
        try:
            control()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            control_errors.append(e)

    def move() -> None:
        try:
            data["result"] = data_plane()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            data["error"] = e

    control_thread = _start(call, "hotswap-weight-sync-control")
    data_thread = _start(move, "hotswap-weight-sync-data")
    while data_thread.is_alive():
        data_thread.join(0.05)
        if control_errors and data_thread.is_alive():
            data_thread.join(CONTROL_FAILURE_GRACE_S)  # a refusal may still drain the data
            if data_thread.is_alive():
                raise control_errors[0]
    control_thread.join()
    if control_errors:
        raise control_errors[0] from data.get("error")
    if "error" in data:
        raise data["error"]
    return data["result"]


CONTROL_FAILURE_GRACE_S = 2.0


def _start(target: Callable[[], None], name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread
