"""The engine core's weights (docs/design.md §4): every path that writes them (a disk reload,
tensors sent inline, a trainer's round), the version each write commits, and what callers
read about the loaded weights (version, label, digest, checksums); the handlers of the verbs
that do these (verbs.py's weights section)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hotswap.config import EngineConfig
from hotswap.engine.core_outputs import WeightVersion
from hotswap.engine.errors import EngineStateError
from hotswap.engine.handlers import Outputs, handles
from hotswap.engine.messages import EngineCoreOutput
from hotswap.engine.request_manager import RequestManager
from hotswap.engine.scheduler import Scheduler
from hotswap.engine.sleep import WEIGHTS, SleepState
from hotswap.engine.verbs import (
    FinishWeightUpdate,
    GetWeightChecksums,
    GetWeightInfo,
    GetWeightVersion,
    GetWorldSize,
    InitWeightTransfer,
    InlineTensor,
    LeaveWeightTransfer,
    LoadWeightsFromDisk,
    LoadWeightsInline,
    PrepareWeightUpdate,
    StartWeightUpdate,
    UpdateWeightLabel,
    UpdateWeights,
    UpdateWeightVersion,
    WeightUpdateActive,
    verb_name,
)
from hotswap.errors import InvalidArgument
from hotswap.execution.runner import ModelRunner
from hotswap.lora.stage import AdapterStage
from hotswap.weight_transfer.backends import get_backend
from hotswap.weights.round import WeightApplyError
from hotswap.weights.sync import WeightSync

Version = dict[str, int | str]  # {version, label}


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
        self._refuse_while_weights_sleep(verb_name(LoadWeightsInline))
        self.sync.refuse_during_round(verb_name(LoadWeightsInline))
        with self._missing_if_it_fails():
            staged = self.sync.load_inline(tensors)
        if self.sleep_state.weights_missing and self.sync.covers_model(staged, True):
            self.sleep_state.weights_missing = False
        return self.commit(label or self.versions.label)

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
        self.scheduler.kv.set_weight_version(self.versions.version)
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

    def get_version(self) -> Version:
        return {"version": self.versions.version, "label": self.versions.label}

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

    def committed(self, digest: bool) -> dict[str, object]:
        """The answer to a finish: {version, label, digest}, taken in the same call as the
        commit so it names exactly that commit. The digest reads every weight (~0.3 s for
        the default model), so it is computed only when asked for; otherwise None."""
        return {**self.get_version(), "digest": self.digest() if digest else None}

    # -- the verbs (handlers.py): each answers its call ---------------------------------------
    @handles(LoadWeightsFromDisk)
    def on_load_weights_from_disk(self, args: LoadWeightsFromDisk, out: Outputs) -> Version:
        out.extend(self.load_from_disk(args.model_path, args.weight_version))
        return self.get_version()

    @handles(LoadWeightsInline)
    def on_load_weights_inline(self, args: LoadWeightsInline, out: Outputs) -> Version:
        out.extend(self.load_inline(args.tensors, args.weight_version))
        return self.get_version()

    @handles(InitWeightTransfer)
    def on_init_weight_transfer_engine(self, args: InitWeightTransfer, out: Outputs) -> None:
        self.sync.init(args.init_info)

    @handles(LeaveWeightTransfer)
    def on_leave_weight_transfer(self, args: LeaveWeightTransfer, out: Outputs) -> bool:
        """Leave the trainer's channel; True if there was one. Never mid-round."""
        self.sync.refuse_during_round(verb_name(LeaveWeightTransfer))
        had = self.sync.transfer is not None
        self.sync.drop_transfer()
        return had

    @handles(StartWeightUpdate)
    def on_start_weight_update(self, args: StartWeightUpdate, out: Outputs) -> None:
        """Open a round into the model's weights, or, with `lora_name`, into that LoRA
        adapter (its PEFT tensors; `lora_config` declares a new one)."""
        self._refuse_while_weights_sleep(verb_name(StartWeightUpdate))
        if args.lora_name is None:
            if args.lora_config is not None:
                raise InvalidArgument("lora_config", "lora_config: needs lora_name")
            self.sync.start(args.is_checkpoint_format)
            return
        if not args.is_checkpoint_format:
            raise InvalidArgument("is_checkpoint_format", "is_checkpoint_format: an adapter's "
                                  "round sends its PEFT tensors (checkpoint format)")  # fmt: skip
        self.sync.refuse_during_round(verb_name(StartWeightUpdate))
        loras, in_use = self.requests.loras, self.requests.adapters_in_use()
        self.sync.start(True, loras.open_stage(args.lora_name, args.lora_config, in_use))

    @handles(UpdateWeights)
    def on_update_weights(self, args: UpdateWeights, out: Outputs) -> int:
        return self.sync.update(args.update_info)

    @handles(PrepareWeightUpdate)
    def on_prepare_weight_update(self, args: PrepareWeightUpdate, out: Outputs) -> int:
        return self.sync.prepare()

    @handles(FinishWeightUpdate)
    def on_finish_weight_update(self, args: FinishWeightUpdate, out: Outputs) -> dict[str, Any]:
        adapter = self.round_adapter()
        out.extend(self.finish_update(args.weight_version, args.abort, args.kv_policy))
        answer = self.committed(args.digest and not args.abort)
        if adapter is not None and not args.abort:  # the adapter's version, not the weights'
            version = self.requests.loras.adapters[adapter].version
            answer.update(lora_name=adapter, lora_version=version)
        if args.checksum and not args.abort:
            answer["checksums"] = self.checksums()
        return answer

    @handles(GetWorldSize)
    def on_get_world_size(self, args: GetWorldSize, out: Outputs) -> int:
        transfer, config = self.sync.transfer, self.config.weight_transfer
        if transfer is not None:
            return transfer.world_size()
        if config is None:
            return 1
        return get_backend(config.backend).receivers(self.config.tensor_parallel_size)

    @handles(GetWeightInfo)
    def on_get_weight_info(self, args: GetWeightInfo, out: Outputs) -> dict[str, object]:
        """{version, label, digest} of the loaded weights (digest None while they sleep)."""
        return self.committed(digest=True)

    @handles(UpdateWeightVersion)
    def on_update_weight_version(self, args: UpdateWeightVersion, out: Outputs) -> Version:
        out.extend(self.commit(args.label))
        return self.get_version()

    @handles(GetWeightVersion)
    def on_get_weight_version(self, args: GetWeightVersion, out: Outputs) -> Version:
        return self.get_version()

    @handles(UpdateWeightLabel)
    def on_update_weight_label(self, args: UpdateWeightLabel, out: Outputs) -> Version:
        """Rename the current weights; the version (and so provenance order) is unchanged."""
        self.versions.label = args.label
        return self.get_version()

    @handles(WeightUpdateActive)
    def on_weight_update_active(self, args: WeightUpdateActive, out: Outputs) -> bool:
        return self.sync.round_open

    @handles(GetWeightChecksums)
    def on_get_weight_checksums(self, args: GetWeightChecksums, out: Outputs) -> dict[str, str]:
        return self.checksums() or {}
