"""`AsyncLLM`: streaming generation with pause/resume, aborts and weight versions.

The engine core runs its own loop (a thread here; a process with the ZMQ client); this
front-end tokenizes, detokenizes and routes each batch of outputs to its request's stream
before it answers any control call carried in the same batch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import torch

from hotswap.config import EngineConfig
from hotswap.engine.core_client import EngineCoreClient, InprocEngineClient, MPEngineClient
from hotswap.engine.dp_client import DPEngineClient
from hotswap.engine.errors import EngineDeadError, EngineStateError, InvalidArgument
from hotswap.engine.messages import CallError, EngineCoreOutputs, EngineCoreRequest, UtilityCall
from hotswap.engine.output_processor import OutputProcessor
from hotswap.engine.prompts import (
    MAX_SESSION_ID_CHARS,
    Prompt,
    check_kv_retention,
    check_priority,
    check_prompt,
    encode_with_images,
    is_session_id,
    prepare_params,
    prompt_cache_salt,
)
from hotswap.engine.verb_methods import with_verb_methods
from hotswap.engine.verbs import Args, CollectiveRpc, LoadLoraAdapter, LoadWeightsInline, make_args
from hotswap.engine_args import EngineArgs
from hotswap.lora.loaded import LoadedAdapters
from hotswap.lora.request import LoRARequest
from hotswap.multimodal.prompt_images import PromptImages
from hotswap.outputs import RequestOutput
from hotswap.sampling_params import SamplingParams
from hotswap.tokenizer import Tokenizer
from hotswap.weight_transfer.inline import inline_tensors


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@with_verb_methods(coroutine=True)
class AsyncLLM:
    """Streaming generation, and a coroutine method per control verb (verb_methods.py:
    `pause_generation`, `sleep`, `finish_weight_update`, ...; their parameters are the
    verbs' arguments), besides the few written out below."""

    def __init__(
        self,
        model: str | None = None,
        *,
        multiprocess: bool = False,
        progress: bool = True,
        **engine_args: Any,
    ) -> None:
        """`multiprocess=True` runs the engine core in a child process over ZMQ (what the
        server uses), or in Ray actors with data_parallel_backend="ray"; otherwise it runs
        on a thread of this process."""
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"AsyncLLM: unknown engine argument(s) {sorted(unknown)}")
        args = EngineArgs(model=model, **engine_args)
        self.config = args.create_engine_config()
        self.data_parallel_size = args.data_parallel_size
        self.tokenizer = Tokenizer.from_pretrained(self.config.tokenizer)
        self.processor = OutputProcessor(self.tokenizer)
        self.images = PromptImages.for_model(self.config.model.path, self.config.model.hf_config,
                                             self.config.media)  # fmt: skip
        self.client = _engine_client(args, self.config, multiprocess, progress)
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._request_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: BaseException | None = None
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished: collections.Counter[str] = collections.Counter()
        self._loras = LoadedAdapters()

    # -- generation -----------------------------------------------------------------------
    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        *,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
        priority: int = 0,
        kv_retention_s: float = 0.0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (cumulative or delta, per `output_kind`). Leaving
        the loop early, or cancelling the consumer, aborts the request and frees its KV.
        `lora_request`: the adapter it runs on, loaded on every engine core when first
        named (vLLM's). With data parallelism, `data_parallel_rank` pins the rank (vLLM's)
        and `session_id` keeps a multi-turn session on one rank (`--dp-routing`).
        `priority`: under `--scheduling-policy priority`, lower is admitted first (vLLM's;
        unused under fcfs). `kv_retention_s`: keep its KV that long after it finishes, for
        its session's next turn (soft: taken last, released by a weight commit)."""
        self._start()
        # The request's hints for the engine (EngineCoreRequest fields), checked up front.
        hints = self._routing(data_parallel_rank, session_id)
        hints["priority"] = check_priority(priority)
        hints["kv_retention_s"] = check_kv_retention(kv_retention_s)
        params = sampling_params or SamplingParams(**self.config.default_sampling)
        request_id = request_id or f"req-{next(self._request_ids)}"
        if lora_request is not None and self._loras.needs_load(lora_request):
            await self.load_lora_adapter(lora_request.lora_name, lora_request.lora_path, True)
        lora_name = lora_request.lora_name if lora_request is not None else None
        stream = self._submit(request_id, prompt, params, lora_name, hints)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            children = self.processor.abort_request(request_id)
            if not finished and self._dead is None:
                self.client.abort_requests(children)

    def _routing(self, rank: int | None, session_id: str | None) -> dict[str, Any]:
        """The routing hints of a request, checked (InvalidArgument naming the field)."""
        size = self.data_parallel_size
        if rank is not None and (not _is_int(rank) or not 0 <= rank < size):
            raise InvalidArgument("data_parallel_rank", f"data_parallel_rank: must be an "
                                  f"integer in [0, {size}), got {rank!r}")  # fmt: skip
        if session_id is not None and not is_session_id(session_id):
            raise InvalidArgument("session_id", "session_id: must be a non-empty string of at "
                                  f"most {MAX_SESSION_ID_CHARS} characters")  # fmt: skip
        return {"data_parallel_rank": rank, "session_id": session_id}

    def _submit(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        lora_name: str | None,
        hints: dict[str, Any] | None = None,
    ) -> asyncio.Queue[RequestOutput | BaseException]:
        if request_id in self._streams:
            raise InvalidArgument("request_id", f"request_id: {request_id!r} is already in use")
        text, ids, images = encode_with_images(self.tokenizer, self.images, prompt)
        check_prompt(ids, self.config.model.vocab_size, self.config.scheduler.max_model_len)
        params.check_prompt_length(len(ids))
        prepare_params(params, self.tokenizer, self.config)
        salt = prompt_cache_salt(prompt)
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        self._prompt_tokens += len(ids)
        for child_id, child_params in self.processor.add_request(request_id, text, ids, params):
            self.client.add_request(
                EngineCoreRequest(
                    child_id,
                    ids,
                    child_params,
                    self.tokenizer.eos_token_id,
                    time.monotonic(),
                    cache_salt=salt,
                    lora_name=lora_name,
                    images=images,
                    **(hints or {}),
                )
            )
        return stream

    async def abort(self, request_ids: str | Iterable[str] | None = None) -> int:
        """Abort requests (None: all); their streams end with finish_reason "abort".
        Returns how many of them were still unfinished."""
        self._start()
        if request_ids is None:
            ids = list(self.processor.requests)
        else:
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        children = {rid: self.processor.child_ids(rid) for rid in ids}
        self.client.abort_requests([child for group in children.values() for child in group])
        return sum(1 for group in children.values() if group)

    # -- control: a method per verb (made by with_verb_methods), and these ---------------
    # LoRA adapters (what the cores hold is followed in `call_with`)
    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, load_inplace: bool = False
    ) -> dict[str, Any]:
        """Load a PEFT adapter under `lora_name` on every engine core (see the verb), in
        two phases: every core checks and holds it, then all serve it; if any refuses, none
        does (each keeps what it had)."""
        try:
            await self.call(LoadLoraAdapter, lora_name=lora_name, lora_path=lora_path,
                            load_inplace=load_inplace, prepare=True)  # fmt: skip
        except BaseException:
            with contextlib.suppress(Exception):
                await self.commit_lora_adapter(lora_name, abort=True)
            raise
        return await self.commit_lora_adapter(lora_name)

    @property
    def loaded_adapters(self) -> dict[str, str]:
        """The adapters the cores hold, as this front-end saw them loaded, committed by a
        weight round ("" path) or unloaded: name -> path (what a server lists and accepts
        as `model`)."""
        return dict(self._loras.by_name)

    # The one control method with a body: it turns tensors into the verb's inline form.
    async def load_weights_inline(
        self,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        """Load these tensors by value (checkpoint names; only they change) between two
        steps, validated and all or nothing as a disk reload, and commit a new version
        labelled `weight_version` (default: the current label); returns {version, label}.
        Their bytes travel in the call: for whole models use a weight transfer backend."""
        return await self.call(
            LoadWeightsInline, tensors=inline_tensors(tensors), weight_version=weight_version
        )

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple | list = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Call `method` of the worker extension (`worker_extension_cls`) on every engine
        core and every tensor-parallel rank of each; one result per rank. `timeout` bounds
        the wait here (TimeoutError), as in vLLM; a method already running finishes in the
        engine regardless."""
        call = self.call(CollectiveRpc, method=method, args=list(args), kwargs=kwargs or {})
        return await asyncio.wait_for(call, timeout)

    def front_end_stats(self) -> dict[str, Any]:
        """Counters kept as requests pass this front-end: prompt and generated tokens,
        finished requests by reason; with data parallelism, how requests were routed."""
        return {
            "prompt_tokens": self._prompt_tokens,
            "generation_tokens": self._generation_tokens,
            "finished_requests": dict(self._finished),
            **self.client.routing_stats(),
        }

    def shutdown(self) -> None:
        self.client.shutdown()
        if self._dead is None:
            self._fail_all(EngineDeadError("AsyncLLM was shut down"))

    # -- plumbing -------------------------------------------------------------------------
    def _start(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self.client.start(self._from_engine)
        elif loop is not self._loop:
            raise RuntimeError("AsyncLLM: used from a second event loop")

    async def call(self, verb: str | type[Args], **arguments: Any) -> Any:
        """Invoke a control verb (verbs.py: its class, or its name); the verbs' methods are
        this with their arguments. Refused arguments raise InvalidArgument naming the field,
        before anything reaches the engine."""
        return await self.call_with(make_args(verb, arguments))

    async def call_with(self, args: Args) -> Any:
        """Invoke the verb whose (validated) arguments these are."""
        self._start()
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        self.client.call_utility(UtilityCall(call_id, args))
        answer = await future
        self._loras.observe(args, answer)
        return answer

    def _from_engine(self, batch: EngineCoreOutputs) -> None:
        """Runs on the client's thread: hand the batch to the event loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._handle_batch, batch)

    def _handle_batch(self, batch: EngineCoreOutputs) -> None:
        if batch.engine_error is not None:
            self._fail_all(EngineDeadError(f"engine core died:\n{batch.engine_error}"))
            return
        for raw in batch.outputs:
            self._generation_tokens += len(raw.new_token_ids)
            if raw.finish_reason is not None:
                self._finished[raw.finish_reason] += 1
        outputs, to_abort, to_stop = self.processor.process(batch.outputs)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
        self.client.abort_requests(to_abort)
        self.client.abort_requests(to_stop, stopped=True)
        for result in batch.results:
            future = self._calls.pop(result.call_id, None)
            if future is None or future.done():
                continue
            if result.error is None:
                future.set_result(result.result)
            else:
                future.set_exception(raised_error(result.error))

    def _fail_all(self, error: BaseException) -> None:
        self._dead = error
        for stream in self._streams.values():
            stream.put_nowait(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()


def _engine_client(
    args: EngineArgs, config: EngineConfig, multiprocess: bool, progress: bool
) -> EngineCoreClient:
    """Where the engine cores run: child processes (one, or one per data-parallel rank),
    Ray actors (backend "ray"), or a thread of this process."""
    out_of_process = args.data_parallel_size > 1 or args.data_parallel_backend == "ray"
    if out_of_process and not multiprocess:
        raise ValueError(
            f"data_parallel_{'size' if args.data_parallel_size > 1 else 'backend'}: "
            "engine cores run in child processes or Ray actors; use multiprocess=True "
            "(hotswap serve does)"
        )
    if args.data_parallel_backend == "ray":
        # The one import of the Ray integration from the core, deferred: it loads Ray
        # only when asked for (tests/test_import_layering.py allows exactly this module).
        from hotswap.ray.dp import RayRankLauncher

        return DPEngineClient(args, RayRankLauncher(args))
    if args.data_parallel_size > 1:
        return DPEngineClient(args)
    if multiprocess:
        return MPEngineClient(args)
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)  # the engine runs in this process
    return InprocEngineClient(config, progress=progress)


def raised_error(error: CallError) -> Exception:
    """The exception a refused call raises in the caller, from its typed form."""
    if error.kind == "invalid":
        return InvalidArgument(error.field, error.message)
    if error.kind == "state":
        return EngineStateError(error.message)
    return RuntimeError(error.message)
