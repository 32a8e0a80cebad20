"""The trainer side of a schedule's weight rounds, over the engine's configured backend
and a weight-sync client (in-process or HTTP). Blocking, as trainer code is: drivers run
it on a thread beside the event loop that serves the engine.

`ipc` sends whole tensors (a fresh trainer engine per round, as trainers that re-init do);
`sparse` sends the elements that differ from the weights the engine holds (one broadcast
group per engine, kept across rounds). An aborted round stages real tensors and then
fails, as a trainer killed mid-round: the engine must keep its weights.
"""

from __future__ import annotations

import contextlib

from hotswap.weight_transfer import (
    IPCTrainerInitInfo,
    SparseTrainerInitInfo,
    TensorSource,
    WeightTransferTrainerFactory,
    diff_patches,
)
from hotswap.weight_transfer.base import checked_items
from tests.exactness.weights import PlannedRound, WeightState
from tests.weight_transfer.conftest import free_port


class TrainerKilled(RuntimeError):
    """Raised inside an aborted round's data plane."""


class Trainer:
    def __init__(self, client: object, backend: str) -> None:
        self.client = client
        self.backend = backend
        self._sparse = None  # the sparse trainer engine, once connected

    def send(
        self, planned: PlannedRound, before: WeightState, label: str, kv_policy: str | None
    ) -> None:
        if self.backend == "sparse":
            before_sent = {name: before.tensors[name] for name, _ in planned.sent}
            patches = diff_patches(before_sent, dict(planned.sent))
            if patches:
                self._sparse_engine().send_patches(patches, label)
            else:  # nothing differs: send_patches sends no round; commit an empty one
                self._sparse_engine()
                self.client.start_weight_update()
                self.client.finish_weight_update(label)
            return
        engine = self._ipc_engine(planned)
        try:
            options = {"kv_policy": kv_policy} if kv_policy else {}
            engine.send_weights(label, **options)
        finally:
            engine.shutdown()

    def abort(self, planned: PlannedRound, label: str) -> None:
        """Start a round, stage half of its tensors (ipc) and die: the engine aborts it."""
        if self.backend == "sparse":
            self._sparse_engine()
            self.client.start_weight_update()
            self.client.finish_weight_update(abort=True)
            return
        engine = self._ipc_engine(planned)
        metas, tensors = checked_items(engine.source)
        half = max(1, len(metas) // 2)

        def killed_midway() -> None:
            engine.send_round(metas[:half], tensors[:half])
            raise TrainerKilled("the trainer died mid-round")

        try:
            with contextlib.suppress(TrainerKilled):
                engine.run_round(killed_midway, label)
        finally:
            engine.shutdown()

    def close(self) -> None:
        if self._sparse is not None:
            self._sparse.shutdown()
            self._sparse = None

    def _ipc_engine(self, planned: PlannedRound):  # noqa: ANN202
        source = TensorSource(list(planned.sent))
        return WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(), self.client, source)

    def _sparse_engine(self):  # noqa: ANN202
        if self._sparse is None:
            info = SparseTrainerInitInfo(master_port=free_port(), world_size=2)
            self._sparse = WeightTransferTrainerFactory.trainer_init(info, self.client, None)
        return self._sparse
