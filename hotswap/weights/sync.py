"""The engine side of the four-phase weight update (docs/design.md §4).

A round stages every received tensor, validated before it is received into the stage
(names, shapes, dtypes); the model is written only at `finish`, all at once. So a round
that fails before `finish` (bad chunk, dead trainer, timeout) leaves the engine serving its
previous weights, and no step ever sees a half-updated model: the engine runs no step while
a round is open, or, with `in_flight`, keeps stepping on the committed weights while chunks
are staged beside it, and `finish` writes the stage between two steps. No backup is
kept: a write failing midway at `finish` (not expected after validation) marks the weights
incomplete, and no step runs until a complete round lands.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hotswap.engine.errors import EngineStateError
from hotswap.engine.verbs import InlineTensor
from hotswap.errors import InvalidArgument
from hotswap.lora.stage import AdapterStage
from hotswap.weight_transfer.backends import create_transfer_engine, get_backend
from hotswap.weight_transfer.base import Delta, ParamMeta
from hotswap.weight_transfer.config import WeightTransferConfig
from hotswap.weight_transfer.engine import STAGED, WeightTransferEngine
from hotswap.weights.double_buffer import ShadowWeights, fits
from hotswap.weights.round import (
    LocalWriter,
    RankWriter,
    Round,
    drain,
    fresh_allocator,
    write_round,
)
from hotswap.weights.targets import WeightTargets, claimed_entry

logger = logging.getLogger(__name__)


class WeightSync:
    def __init__(
        self,
        model: nn.Module,
        writer: RankWriter,
        config: WeightTransferConfig | None,
        device: torch.device,
        allowed_weight_dirs: tuple[Path, ...] | None = None,
    ) -> None:
        self.model, self.config, self.device = model, config, device
        # What writes a committed round into the model (on every tensor-parallel rank).
        self.writer = writer
        # Where disk rounds may read (real paths; None: anywhere): see EngineArgs.
        self.allowed_weight_dirs = allowed_weight_dirs
        self.transfer: WeightTransferEngine | None = None
        self.round: Round | None = None
        # Set to cancel an `init` waiting for the trainer's group (the loop replaces it
        # before each init, so a cancel can never reach the wrong one).
        self.join_cancel = threading.Event()
        # Last round's receive buffers, reused by name: one extra copy of what was sent,
        # held between rounds, so a round copies into warm memory (no page faults).
        self._pool: dict[str, torch.Tensor] = {}
        self.targets = WeightTargets(model)
        # Double buffering (double_buffer.py): rounds are written into a second copy of the
        # weights and the commit swaps the two. None: the commit copies the stage in.
        # Every tensor-parallel rank keeps a shadow of its share (weights/double_buffer.py); this is
        # rank 0's, and the writer writes and switches them all.
        self.shadow: ShadowWeights | None = None
        ranks = model.tp.size if device.type == "cpu" else 1  # sharing the host's memory
        if config and config.double_buffer and fits(model, device, config.allow_copy_fallback,
                                                    ranks):  # fmt: skip
            self.shadow = writer.rank_shadow()

    @property
    def round_open(self) -> bool:
        return self.round is not None

    def refuse_during_round(self, what: str) -> None:
        """For calls that write or free the weights outside a round, which must not interleave."""
        if self.round_open:
            raise EngineStateError(
                f"{what}: a weight update round is open; finish or abort it first"
            )

    def _require_config(self) -> WeightTransferConfig:
        if self.config is None:
            raise EngineStateError(
                "weight transfer is not configured: start the engine with "
                'weight_transfer_config (--weight-transfer-config \'{"backend": "gloo"}\')'
            )
        return self.config

    # -- phases ---------------------------------------------------------------------------
    def init(self, init_info: object) -> None:
        config = self._require_config()
        if self.round_open:
            raise EngineStateError("init_weight_transfer_engine: a round is open; finish it")
        if not isinstance(init_info, dict):
            raise InvalidArgument("init_info", "init_info: must be a JSON object")
        engine = self._confined(create_transfer_engine(config, self.device))
        engine.cancel = self.join_cancel
        engine.attach(self.writer)  # the ranks, for a backend where every rank receives
        if config.reuse_receive_buffers:
            engine.allocate = self._pooled
        engine.init_transfer_engine(init_info)
        if self.transfer is not None:
            self.transfer.shutdown()
        self.transfer = engine

    def start(
        self, is_checkpoint_format: object = True, adapter: AdapterStage | None = None
    ) -> None:
        """Open a round into the model's weights, or into `adapter` (a LoRA adapter's
        stage: its PEFT tensors, committed as a new adapter version)."""
        config = self._require_config()
        if not isinstance(is_checkpoint_format, bool):
            raise InvalidArgument("is_checkpoint_format", "is_checkpoint_format: must be a boolean")
        if not is_checkpoint_format and adapter is None and self.model.tp.parallel:
            raise InvalidArgument(
                "is_checkpoint_format",
                "is_checkpoint_format: engine-format rounds (hotswap's fused parameters) "
                "are not supported with tensor_parallel_size > 1; send checkpoint tensors",
            )
        if self.round_open:
            raise EngineStateError(
                "start_weight_update: a round is already open; call finish_weight_update first"
            )
        if self.transfer is None:
            if get_backend(config.backend).needs_init:
                raise EngineStateError(
                    "start_weight_update: call init_weight_transfer_engine first"
                )
            self.init({})
        assert self.transfer is not None
        self.transfer.start_weight_update()
        targets = self.targets if adapter is None else WeightTargets(adapter)
        self.round = Round(is_checkpoint_format, targets)

    def update(self, update_info: object) -> int:
        """Receive one chunk into the stage; returns how many tensors it held."""
        if self.round is None or self.transfer is None:
            raise EngineStateError("update_weights: no round is open; call start_weight_update")
        if not isinstance(update_info, dict):
            raise InvalidArgument("update_info", "update_info: must be a JSON object")
        self.round.last_call = time.monotonic()
        try:
            metas = self.transfer.parse_update_info(update_info)
        except ValueError:
            if self.transfer.needs_init:
                # A stream channel's sender is already sending what we cannot size: the
                # channel is out of step and must be set up again.
                self.transfer.shutdown()
                self.transfer, self.round = None, None
            raise
        checkpoint = self.round.is_checkpoint_format
        targets, sparse = self.round.targets, self.transfer.sends_deltas
        problems = [(i, p) for i, m in enumerate(metas)
                    if (p := targets.check(m, checkpoint, sparse)) is not None]  # fmt: skip
        if problems:  # drained into scratch memory: never over a buffer staged earlier
            self.transfer.allocate = fresh_allocator(self.device)
        try:
            if problems:
                # Keep the channel in step with the sender; what the sender claimed (a
                # shape, a name) is the error to report, not what draining it ran into.
                with contextlib.suppress(ValueError):
                    drain(self.transfer.receive_weights(update_info, metas))
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                # What the chunk's update_info claims does not fit the model.
                index, (what, why) = problems[0]
                raise InvalidArgument(claimed_entry(update_info, what, index), why + more)
            self.round.note_sent(metas)
            if self.shadow is not None and self.round.adapter is None:
                self._receive_into_shadow(update_info, metas)
            else:  # items are as the checked metas describe (the backend contract)
                for name, item in self.transfer.receive_weights(update_info, metas):
                    if isinstance(item, Delta):
                        self.round.deltas.append((name, item))
                    else:
                        self.round.staged[name] = item
        except ValueError:
            raise  # refused chunk: nothing staged from it is used; the round stays open
        except Exception as e:
            self._fail_transport(e)
        finally:
            if self.transfer is not None and self.config and self.config.reuse_receive_buffers:
                self.transfer.allocate = self._pooled
            if self.round is not None:  # idle time counts from the end of the receive
                self.round.last_call = time.monotonic()
        return len(metas)

    def _receive_into_shadow(self, update_info: dict[str, Any], metas: list[ParamMeta]) -> None:
        """Double buffering: every received tensor (and delta) goes straight into the
        shadow, in place where its dtype and shape allow; the stage records where."""
        assert self.round is not None and self.transfer is not None and self.shadow is not None
        shadow, checkpoint, round_ = self.shadow, self.round.is_checkpoint_format, self.round
        round_.in_shadow = True
        fallback = self.transfer.allocate
        targets = {m.name: self._param_target(m.name, checkpoint) for m in metas}
        self.transfer.allocate = lambda m: shadow.receive_buffer(m, targets.get(m.name), fallback)
        sliced = checkpoint and self.model.tp.parallel  # this rank holds a part of each
        # under expert parallelism a name rank 0 ignores may be another rank's expert:
        # forwarded all the same (each rank writes what it holds, skips the rest)
        others = checkpoint and self.model.tp.expert_parallel
        received = []
        try:
            for name, item in self.transfer.receive_weights(update_info, metas):
                target = targets[name]
                if target is not None:
                    piece = self.model.checkpoint_slice(name) if sliced else None
                    round_.staged[name] = self.writer.write_shadow(target, item, piece)
                if target is not None or others:  # else a name the model ignores
                    received.append((name, item))
        finally:
            self.transfer.allocate = fallback
        self.writer.forward_to_shadows(received)  # the other ranks' parts

    def _param_target(self, name: str, checkpoint: bool) -> tuple[str, torch.Tensor] | None:
        """(parameter name, the live view `name` is written to), or None if ignored."""
        target = self.targets.target(name, checkpoint)
        return None if target is None else (target[0].partition("#")[0], target[1])

    def prepare(self) -> int:
        """Phase one of a commit across several engines: everything `finish` checks,
        without applying; the round stays open. Returns how many tensors are staged."""
        if self.round is None:
            raise EngineStateError("prepare_weight_update: no round is open")
        self.round.check_fp8_pairs()
        if self.round.must_be_complete(self.config):
            self.round.targets.check_complete(set(self.round.staged),
                                              self.round.is_checkpoint_format)  # fmt: skip
        # The commit follows: the round must not expire between the two phases.
        self.round.last_call = time.monotonic()
        return len(self.round.staged) + len(self.round.deltas)

    def finish(self, abort: bool = False) -> dict[str, torch.Tensor] | None:
        """Validate coverage and write the stage into the model (all or nothing). Returns
        None when aborted; otherwise the round closes and the caller commits a version."""
        if self.round is None:
            raise EngineStateError("finish_weight_update: no round is open")
        round_, self.round = self.round, None
        if self.transfer is not None:
            self.transfer.finish_weight_update()
        if abort:
            logger.info("weight update round aborted by the caller")
            self._discard(round_)
            return None
        try:
            round_.check_fp8_pairs()
            if round_.must_be_complete(self.config):
                round_.targets.check_complete(set(round_.staged), round_.is_checkpoint_format)
        except InvalidArgument:
            self._discard(round_)  # refused as a whole: what it staged is dropped
            raise
        self._apply(round_)
        return round_.staged

    def reload_from_disk(self, model_dir: str) -> None:
        """One complete checkpoint-format round from a safetensors directory, whatever
        backend is configured (SGLang's /update_weights_from_disk; reloading after sleep
        level 2): the same validation, staging and commit as any round."""
        from hotswap.weight_transfer.disk import DiskEngine

        if self.round_open:
            raise EngineStateError("update_weights_from_disk: a round is open; finish it first")
        configured, self.transfer = self.transfer, self._confined(DiskEngine(self.device))
        self.round = Round(True, self.targets)
        try:
            self.update({"model_path": model_dir})
            round_, self.round = self.round, None
            round_.check_fp8_pairs()
            self.targets.check_complete(set(round_.staged), round_.is_checkpoint_format)
            self._apply(round_)
        except ValueError as e:
            # `model_path` is the one argument: whatever its checkpoint fails (a file, a
            # header, a shape, a missing weight) is reported as it.
            raise InvalidArgument("model_path", str(e)) from e
        finally:
            self.round, self.transfer = None, configured

    def load_inline(self, tensors: list[InlineTensor]) -> dict[str, torch.Tensor]:
        """One checkpoint-format round from tensors sent by value (verbs.InlineTensor:
        the `load_weights_inline` verb), whatever backend is configured: validated (bytes,
        dtypes, names, shapes; refusals name `tensors[i].field`), staged, then written all
        at once, as a disk reload. Only the tensors sent change (SGLang's semantics), unless
        the config's `require_complete` asks for every weight. Returns the staged tensors."""
        from hotswap.weight_transfer.inline import ARGUMENT, InlineEngine

        if self.round_open:
            raise EngineStateError("load_weights_inline: a round is open; finish it first")
        info = {ARGUMENT: tensors}
        configured, self.transfer = self.transfer, InlineEngine(self.device)
        self.round = Round(True, self.targets)
        try:
            metas = self.transfer.parse_update_info(info)
            for i, meta in enumerate(metas):
                problem = self.targets.check(meta, True)
                if problem is not None:
                    field = f"{ARGUMENT}[{i}].{problem[0]}"
                    raise InvalidArgument(field, f"{field}: {problem[1].removeprefix('weights: ')}")
            self.round.note_sent(metas)
            for name, tensor in self.transfer.receive_weights(info, metas):
                self.round.staged[name] = tensor
            round_, self.round = self.round, None
            round_.check_fp8_pairs()
            if self.config is not None and self.config.require_complete:
                self.targets.check_complete(set(round_.staged), round_.is_checkpoint_format)
            self._apply(round_)
            return round_.staged
        finally:
            self.round, self.transfer = None, configured

    def _confined(self, engine: WeightTransferEngine) -> WeightTransferEngine:
        """`engine`, reading from disk (if it does) only inside the allowed weight
        directories."""
        engine.allowed_dirs = self.allowed_weight_dirs
        return engine

    def expire(self, timeout_s: float) -> bool:
        """Abort a round no call has touched for `timeout_s` (a trainer that died or hangs
        between calls); True if one was aborted. The caller never runs this while a call
        is in progress, so a long receive does not count as idle."""
        if self.round is None or time.monotonic() - self.round.last_call < timeout_s:
            return False
        logger.warning("weight update round idle for over %g s: aborted", timeout_s)
        self._discard(self.round)
        self.round = None
        if self.transfer is not None:
            self.transfer.finish_weight_update()
        return True

    def drop_transfer(self) -> None:
        """Leave the channel (a cancelled init that completed anyway)."""
        if self.transfer is not None:
            self.transfer.shutdown()
            self.transfer = None

    def release_buffers(self) -> None:
        """Drop the pooled receive buffers (sleep frees memory; the next round
        allocates again), and the double buffer."""
        self._pool.clear()
        if self.shadow is not None:
            self.writer.release_shadow()

    def _discard(self, round_: Round) -> None:
        """A round that will not be committed: what it wrote into the shadow is stale."""
        if round_.in_shadow or any(item is STAGED for item in round_.staged.values()):
            self.writer.drop_received()  # every rank's shadow writes and m2n parts

    def covers_model(self, staged: Iterable[str], is_checkpoint_format: bool) -> bool:
        return not self.targets.missing(set(staged), is_checkpoint_format)

    # -- apply ----------------------------------------------------------------------------
    def _pooled(self, meta: ParamMeta) -> torch.Tensor:
        buffer = self._pool.get(meta.name)
        if buffer is None or tuple(buffer.shape) != meta.shape or buffer.dtype != meta.dtype:
            buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
            self._pool[meta.name] = buffer
        return buffer

    @torch.no_grad()
    def _apply(self, round_: Round) -> None:
        """Every staged tensor was checked against its destination (name, shape, dtype
        kind), so the copies cannot fail on the data; no full backup is kept (it would
        double the cost of a sync). If a copy still fails, the model is declared
        incomplete instead of being served half-written. A round written into the double
        buffer is committed by swapping it in."""
        if round_.in_shadow and self.shadow is not None:
            self.writer.swap_shadow()
            return
        model = round_.targets.model
        # The model's own weights go through the writer (every rank); an adapter's stage
        # is this process's alone.
        write_round(round_, self.writer if model is self.model else LocalWriter(model))

    def _fail_transport(self, error: Exception) -> None:
        if self.round is not None:
            self._discard(self.round)
        self.round = None
        if self.transfer is not None:
            self.transfer.shutdown()
            self.transfer = None
        raise EngineStateError(
            f"update_weights: the transfer failed ({type(error).__name__}: {error}); the round "
            f"was aborted, the engine keeps its previous weights; call "
            f"init_weight_transfer_engine again"
        ) from error
