"""The engine core's weights (docs/design.md §4): every path that writes them (a disk reload,
tensors sent inline, a trainer's round), the version each write commits, and what callers
read about the loaded weights (version, label, digest, checksums)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hotswap.config import EngineConfig
from hotswap.engine.core_outputs import WeightVersion
from hotswap.engine.errors import EngineStateError
from hotswap.engine.messages import EngineCoreOutput
from hotswap.engine.request_manager import RequestManager
from hotswap.engine.scheduler import Scheduler
from hotswap.engine.sleep import WEIGHTS, SleepState
from hotswap.engine.verbs import InlineTensor
from hotswap.errors import InvalidArgument
from hotswap.execution.runner import ModelRunner
from hotswap.lora.stage import AdapterStage
from hotswap.weights.round import WeightApplyError
from hotswap.weights.sync import WeightSync


class WeightManager:
    """Writes the weights and commits weight versions.

    Invariants: no model step runs while a weight round is open, unless the round is in
    flight (`round_blocks_steps`); every write commits through `commit`, which bumps the
    version by exactly one and tells the runner to remake copies derived from the
    weights; a write that fails midway marks the weights missing (no step until a
    complete write), and only a write covering the whole model clears that; no write
    starts while the weights sleep or a sleep is pending, nor (outside the round itself)
    while a round is open; after a commit no request runs more than its `max_weight_lag`
    versions past the version of its first token."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        scheduler: Scheduler,
        sleep_state: SleepState,
        weight_sync: WeightSync,
        requests: RequestManager,
        versions: WeightVersion,
    ) -> None:
        self.config = config
        self.runner = runner
        self.scheduler = scheduler
        self.sleep_state = sleep_state
        self.sync = weight_sync
        self.requests = requests
        self.versions = versions
        self._digest: tuple[tuple[int, bool], str] | None = None  # cache key, digest

    @property
    def round_blocks_steps(self) -> bool:
        """An open round stops generation unless it is received in flight (beside the
        steps, on the committed weights, switched at `finish` between two steps)."""
        sync = self.sync
        if sync.round is None or sync.round.adapter is not None:
            return False  # an adapter's round is received beside the served versions
        return not (sync.config is not None and sync.config.in_flight)

    # -- writes ---------------------------------------------------------------------------
    def load_from_disk(self, model_dir: str, label: str | None = None) -> list[EngineCoreOutput]:
        """Reload every weight from a safetensors directory (all or nothing) and commit a
        new version; returns requests aborted by `max_weight_lag`. The loop runs this
        between steps, so no step sees a half-loaded model."""
        self._refuse_while_weights_sleep("update_weights_from_disk")
        self.sync.refuse_during_round("update_weights_from_disk")
        with self._missing_if_it_fails():
            self.sync.reload_from_disk(model_dir)
        self.sleep_state.weights_missing = False
        return self.commit(label or model_dir)

    def load_inline(
        self, tensors: list[InlineTensor], label: str | None = None
    ) -> list[EngineCoreOutput]:
        """Load tensors sent by value (verbs.InlineTensor; only those change) in one
        validated, all-or-nothing round between steps, as a disk reload, and commit a new
        version labelled `label` (default: the current label); returns requests aborted by
        `max_weight_lag`."""
        self._refuse_while_weights_sleep("load_weights_inline")
        self.sync.refuse_during_round("load_weights_inline")
        with self._missing_if_it_fails():
            staged = self.sync.load_inline(tensors)
        if self.sleep_state.weights_missing and self.sync.covers_model(staged, True):
            self.sleep_state.weights_missing = False
        return self.commit(label or self.versions.label)

    def leave_transfer(self) -> bool:
        """Leave the trainer's channel; True if there was one. Never mid-round."""
        self.sync.refuse_during_round("leave_weight_transfer")
        had = self.sync.transfer is not None
        self.sync.drop_transfer()
        return had

    def start_update(
        self,
        is_checkpoint_format: bool = True,
        lora_name: str | None = None,
        lora_config: dict[str, Any] | None = None,
    ) -> None:
        """Open a round into the model's weights, or, with `lora_name`, into that LoRA
        adapter (its PEFT tensors; `lora_config` declares a new one)."""
        self._refuse_while_weights_sleep("start_weight_update")
        if lora_name is None:
            if lora_config is not None:
                raise InvalidArgument("lora_config", "lora_config: needs lora_name")
            self.sync.start(is_checkpoint_format)
            return
        if not is_checkpoint_format:
            raise InvalidArgument("is_checkpoint_format", "is_checkpoint_format: an adapter's "
                                  "round sends its PEFT tensors (checkpoint format)")  # fmt: skip
        self.sync.refuse_during_round("start_weight_update")
        loras = self.requests.loras
        stage = loras.open_stage(lora_name, lora_config, self.requests.adapters_in_use())
        self.sync.start(True, stage)

    def finish_update(
        self, label: str | None = None, abort: bool = False, kv_policy: str | None = None
    ) -> list[EngineCoreOutput]:
        """Apply the round and commit version + 1 (`label`, or the current label). Returns
        requests aborted by `max_weight_lag`. Requests running across the switch keep their
        KV (`keep`: later tokens are marked stale) or drop it and recompute it under the
        new weights before their next token (`recompute`)."""
        checkpoint = self.sync.round is not None and self.sync.round.is_checkpoint_format
        stage = self.sync.round.adapter if self.sync.round is not None else None
        if stage is not None:
            return [] if self.sync.finish(abort) is None else self._commit_adapter(stage)
        with self._missing_if_it_fails():
            staged = self.sync.finish(abort)
        if staged is None:
            return []
        missing = self.sleep_state.weights_missing
        if missing and self.sync.covers_model(staged, checkpoint):
            self.sleep_state.weights_missing = False
        outputs = self.commit(label or self.versions.label)
        config = self.sync.config
        if (kv_policy or (config.kv_policy if config else "keep")) == "recompute":
            self.scheduler.drop_running_kv()
        return outputs

    def _commit_adapter(self, stage: AdapterStage) -> list[EngineCoreOutput]:
        """The adapter's next version from the round (the base weights' version does not
        move); requests on it lagging more than their `max_weight_lag` adapter versions
        behind are aborted (the staleness bound, per adapter)."""
        try:
            adapter = self.requests.loras.commit_stage(stage, self.requests.adapters_in_use())
        except InvalidArgument as e:
            raise InvalidArgument(None, f"finish_weight_update: {e}; nothing was applied") from None
        lagging = {}
        for request in self.scheduler.requests.values():
            limit, held = request.sampling_params.max_weight_lag, request.lora
            if limit is None or held is None or held.name != adapter.name:
                continue
            if adapter.version - held.version > limit:
                lagging[request.request_id] = (
                    f"max_weight_lag: runs on version {held.version} of adapter "
                    f"{adapter.name!r}, now at {adapter.version} (limit {limit})"
                )
        return self.requests.abort(lagging, reasons=lagging)

    def round_adapter(self) -> str | None:
        """The adapter the open round writes into (None: the weights, or no round)."""
        round_ = self.sync.round
        return round_.adapter.name if round_ is not None and round_.adapter is not None else None

    @contextlib.contextmanager
    def _missing_if_it_fails(self) -> Iterator[None]:
        """A write that fails midway (WeightApplyError) leaves the weights incomplete."""
        try:
            yield
        except WeightApplyError:
            self.sleep_state.weights_missing = True
            raise

    def _refuse_while_weights_sleep(self, what: str) -> None:
        if WEIGHTS in self.sleep_state.asleep:
            raise EngineStateError(f"{what}: weights are asleep: wake_up(tags=['weights']) first")
        if self.sleep_state.pending:  # finishing it would take the weights mid-round
            raise EngineStateError(f"{what}: a sleep is in progress; let it finish, then wake_up")

    # -- versions -------------------------------------------------------------------------
    def commit(self, label: str) -> list[EngineCoreOutput]:
        """Commit a new weight version (+1) under `label`; requests that would now lag more
        than their `max_weight_lag` behind their first token's version are aborted."""
        self.versions.version += 1
        self.versions.label = label
        self.scheduler.kv.weight_version = self.versions.version
        # Every path that writes weights commits through here (or says so itself, as
        # collective_rpc does); derived copies of the weights are remade from the new ones.
        self.runner.weights_changed()
        return self._abort_lagging_requests()

    def _abort_lagging_requests(self) -> list[EngineCoreOutput]:
        version = self.versions.version
        lagging = {}
        for request in self.scheduler.requests.values():
            limit = request.sampling_params.max_weight_lag
            start = request.start_version
            if limit is not None and start is not None and version - start > limit:
                lagging[request.request_id] = (
                    f"max_weight_lag: started on weight version {start}, engine is at "
                    f"{version} (limit {limit})"
                )
        return self.requests.abort(lagging, reasons=lagging)

    def get_version(self) -> dict[str, int | str]:
        return {"version": self.versions.version, "label": self.versions.label}

    def set_label(self, label: str) -> dict[str, int | str]:
        """Rename the current weights; the version (and so provenance order) is unchanged."""
        self.versions.label = label
        return self.get_version()

    # -- reads ----------------------------------------------------------------------------
    def digest(self) -> str | None:
        """Digest of the loaded weights (cached per version); None while they sleep."""
        if not self.runner.residency.resident:
            return None
        key = (self.versions.version, self.sleep_state.weights_missing)
        if self._digest is None or self._digest[0] != key:
            self._digest = (key, self.runner.weights_digest())
        return self._digest[1]

    def checksums(self) -> dict[str, str] | None:
        """vLLM's per-tensor checksums: SHA-256 of each weight's bytes (each rank's share),
        keyed `dp{rank}:pp0:pcp0:tp{rank}:ep0:{name}` (one engine core is one dp rank).
        None while the weights sleep."""
        if not self.runner.residency.resident:
            return None
        dp = self.config.data_parallel_rank
        return {
            f"dp{dp}:pp0:pcp0:tp{tp}:ep0:{name}": sha
            for tp, sums in enumerate(self.runner.weight_checksums())
            for name, sha in sums.items()
        }

    def info(self) -> dict[str, object]:
        """{version, label, digest} of the loaded weights (digest None while they sleep)."""
        return self.committed(digest=True)

    def committed(self, digest: bool) -> dict[str, object]:
        """The answer to a finish: {version, label, digest}, taken in the same call as the
        commit so it names exactly that commit. The digest reads every weight (~0.3 s for
        the default model), so it is computed only when asked for; otherwise None."""
        return {**self.get_version(), "digest": self.digest() if digest else None}
