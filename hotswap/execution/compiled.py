"""Compiled decode steps: the CPU analogue of CUDA graphs.

A decode step of a few sequences spends about a third of its time launching operators
from Python (one request on the default model: 20.7 ms eager, of which the weights'
stream is 13.7 ms). For steps of up to `MAX_ROWS` single-token sequences, the model's own
forward (and the LM head) runs instead as one torch.compile graph whose wrapper Inductor
writes in C++ (`cpp_wrapper`): hotswap's kernels and the GEMV are called from it
directly, and the elementwise rest is fused. Two graphs cover every such step, one for a
single sequence and one for 2 to `MAX_ROWS` (batch size dynamic); both are compiled when
the engine starts (Inductor caches them on disk: ~60 s the first time on a machine,
seconds after), so no step ever waits for a compiler.

Inductor's on-disk cache is shared by every engine a user starts, and its key leaves out
the ranges given to `mark_dynamic`, while an entry brings back the guards of the range it
was compiled for. So the ranges do not depend on the configuration (block tables of 2 to
`MAX_BLOCK_COLUMNS` columns, whatever `max_model_len`: one entry serves every length),
and the ranges are in the key (`cache_tag`), so an entry compiled for other ranges (a
longer `max_model_len`, or a hotswap before this) is never taken for these.

A mixture of experts' decode steps compile too where its routed experts run in the one
fused kernel call (model/models/moe.py `graphable`): the routing stays inside that call.
Each sparse block keeps the experts it chose as a module attribute (routing replay);
Dynamo replays that store after the graph runs, so the runner reads them as after an
eager step.

Parameters and the KV caches are graph inputs, not constants: weight updates, swaps and
a re-allocated cache are seen as they are.

Dynamo checks guards before each call to pick a graph. Those on the model's Python state
(every module's attributes, the kernels object its modules share, each parameter's
properties: about 10,000 checks, many of them object-identity checks in Python) cost
0.8-1.2 ms per step on the default model, an eighth of an FP8 decode step. Only the guards
on the step's inputs and the global state are kept (`_input_guards`; which of the two
graphs a step takes, and whether its shapes are in range, is read from them alone), as
vLLM drops its graphs' guards; each engine's graphs hang on a code object of their own, so
no engine's step takes another's graph. That is safe because the model's Python state is
fixed once the graphs are compiled: what changes between steps is a graph input
(parameters, KV caches, LoRA slots: read anew at every call), or sends the step down the
eager path before a graph is called (a step with adapters; the reference weights,
`__call__`; `--calculate-kv-scales`, whose scales are host floats, never compiles decode).

A step the graphs cannot take (prefill chunks, larger batches, a shape they were not
compiled for) runs eagerly; `--enforce-eager`, a batch-invariant engine, torch's own
`TORCH_COMPILE_DISABLE=1`, or a failed compile run every step eagerly, with the same
results up to float rounding. A failed compile says so in one
warning line (torch's own traceback of the guard it could not create is left out).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import types
from collections.abc import Callable, Iterator

import torch
from torch import nn
from tqdm import tqdm

from hotswap.model.attention import AttentionMetadata, build_metadata
from hotswap.model.layers import MATVEC_MAX_ROWS
from hotswap.model.reference_views import REFERENCE_SWITCH

logger = logging.getLogger(__name__)

MAX_ROWS = MATVEC_MAX_ROWS  # beyond it the GEMMs dominate and Python costs little
# Block-table widths every engine's graphs take (1M tokens of context at block size 16);
# a longer max_model_len widens the range, under a key of its own.
MAX_BLOCK_COLUMNS = 1 << 16


def compilation_available() -> bool:
    return not torch._dynamo.config.disable and torch._dynamo.is_dynamo_supported()


class CompiledDecode:
    def __init__(self, model: nn.Module, block_size: int, max_model_len: int) -> None:
        self.model = model
        self.block_size = block_size
        # block-table columns the graphs take: the same for every max_model_len up to
        # MAX_BLOCK_COLUMNS blocks, so that they share one cached compile
        self.max_blocks = max(MAX_BLOCK_COLUMNS, -(-max_model_len // block_size))
        self.compiled_steps = 0  # decode steps the graphs ran
        self.eager_steps = 0  # decode steps they would have had to recompile for
        # this engine's own copy of `_logits`: Dynamo keeps graphs per code object, and
        # their guards no longer tell one engine's model from another's (module doc)
        logits = types.MethodType(_own_code(CompiledDecode._logits), self)
        self._graph: Callable[..., torch.Tensor] = torch.compile(
            logits,
            fullgraph=True,
            options={"cpp_wrapper": True, "guard_filter_fn": _input_guards},
        )

    def _logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, meta))

    @staticmethod
    def applies(num_rows: int, all_decode: bool) -> bool:
        return all_decode and 1 <= num_rows <= MAX_ROWS

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Logits of every row (each samples). Raises RuntimeError rather than compile:
        the caller runs the step eagerly then."""
        if REFERENCE_SWITCH.active:  # state no guard checks (module doc)
            raise RuntimeError("compiled decode: the graphs read FP8 codes, not references")
        _mark_dynamic(input_ids, positions, meta, self.max_blocks)
        with torch.compiler.set_stance("fail_on_recompile"):
            return self._graph(input_ids, positions, meta)

    @torch.inference_mode()  # as the steps run: grad mode is part of the graphs' guards
    def warm_up(self, progress: bool = True) -> bool:
        """Compile both graphs on dummy steps (block 0 of a cache no request holds yet).
        False if compilation failed: the engine then runs eagerly."""
        desc = "Compiling decode steps (cached for later runs)"
        bar = tqdm(total=2, desc=desc, disable=not progress, leave=False)
        tag = cache_tag(self.max_blocks)
        try:
            with torch.compiler.config.patch(cache_key_tag=tag), _without_guard_tracebacks():
                self._compile_both(bar)
        except Exception as e:  # noqa: BLE001 - no compiler, an unsupported op: run eagerly
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            logger.warning("decode steps could not be compiled (%s); running eagerly", reason)
            return False
        finally:
            bar.close()
        return True

    def _compile_both(self, bar: tqdm) -> None:
        device = next(self.model.parameters()).device
        for rows in (1, 2):
            slots = torch.zeros(rows, dtype=torch.long, device=device)
            meta = build_metadata([1] * rows, [1] * rows, [[0]] * rows, slots,
                                  self.block_size, decode_batch=True)  # fmt: skip
            ids = torch.zeros(rows, dtype=torch.long, device=device)
            positions = slots.clone()
            _mark_dynamic(ids, positions, meta, self.max_blocks)
            self._graph(ids, positions, meta)
            bar.update(1)


_ENGINES = itertools.count()


def _own_code(function: Callable) -> Callable:
    """A copy of `function` with a code object of its own (named apart)."""
    name = f"{function.__name__}_{next(_ENGINES)}"
    code = function.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, function.__globals__, name, function.__defaults__,
                              function.__closure__)  # fmt: skip


# What a compiled step's inputs are named in Dynamo's guards (`_logits`' arguments).
_INPUTS = frozenset({"input_ids", "positions", "meta"})


def _input_guards(entries: list) -> list[bool]:  # torch._dynamo.types.GuardFilterEntry
    """Which guards a graph keeps: those on its inputs, and the global state's (grad
    mode, default device, ...: unnamed). See the module doc."""
    return [not e.name or e.name.split(".")[0].split("[")[0] in _INPUTS for e in entries]


def cache_tag(max_blocks: int) -> str:
    """Part of Inductor's cache key while the graphs compile (after any tag the user set
    with TORCH_COMPILE_CACHE_KEY_TAG): the dynamic ranges, which its key leaves out."""
    ranges = f"hotswap decode steps: rows 2..{MAX_ROWS}, block columns 2..{max_blocks}"
    return "; ".join(filter(None, [torch.compiler.config.cache_key_tag, ranges]))


class _NoGuardErrors(logging.Filter):
    """torch logs a guard it could not create (a cached graph's guards against the ranges
    asked for) with a traceback, then raises: warm_up reports what it raised in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


@contextlib.contextmanager
def _without_guard_tracebacks() -> Iterator[None]:
    guards = logging.getLogger("torch._guards")
    quiet = _NoGuardErrors()
    guards.addFilter(quiet)
    try:
        yield
    finally:
        guards.removeFilter(quiet)


def _mark_dynamic(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, max_blocks: int
) -> None:
    """2..MAX_ROWS rows share one graph (one row has its own); block tables of any width
    (at least two columns) share them too."""
    batch = meta.decode_batch
    assert batch is not None
    if input_ids.shape[0] > 1:
        for tensor in (input_ids, positions, meta.slot_mapping, batch.block_tables,
                       batch.context_lens):  # fmt: skip
            torch._dynamo.mark_dynamic(tensor, 0, min=2, max=MAX_ROWS)
    torch._dynamo.mark_dynamic(batch.block_tables, 1, min=2, max=max_blocks)
