"""`AsyncLLM`: streaming generation with pause/resume, aborts and weight versions.

The engine core runs its own loop (a thread here; a process with the ZMQ client); this
front-end tokenizes, detokenizes and routes each batch of outputs to its request's stream
before it answers any control call carried in the same batch.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from hotswap.config import EngineArgs
from hotswap.engine.core import check_pause_mode
from hotswap.engine.core_client import EngineCoreClient, InprocEngineClient, MPEngineClient
from hotswap.engine.messages import EngineCoreOutputs, EngineCoreRequest, UtilityCall
from hotswap.engine.output_processor import OutputProcessor
from hotswap.engine.prompts import Prompt, check_prompt, encode_prompt
from hotswap.outputs import RequestOutput
from hotswap.sampling_params import SamplingParams
from hotswap.tokenizer import Tokenizer


class EngineDeadError(RuntimeError):
    """The engine core stopped; every pending stream and call fails with this."""


class AsyncLLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        multiprocess: bool = False,
        progress: bool = True,
        **engine_args: Any,
    ) -> None:
        """`multiprocess=True` runs the engine core in a child process over ZMQ (what the
        server uses); otherwise it runs on a thread of this process."""
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"AsyncLLM: unknown engine argument(s) {sorted(unknown)}")
        args = EngineArgs(model=model, **engine_args)
        self.config = args.create_engine_config()
        self.tokenizer = Tokenizer.from_pretrained(self.config.tokenizer)
        self.processor = OutputProcessor(self.tokenizer)
        self.client: EngineCoreClient = (
            MPEngineClient(args)
            if multiprocess
            else InprocEngineClient(self.config, progress=progress)
        )
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._request_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: BaseException | None = None

    # -- generation -----------------------------------------------------------------------
    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (cumulative or delta, per `output_kind`). Leaving
        the loop early, or cancelling the consumer, aborts the request and frees its KV."""
        self._start()
        params = sampling_params or SamplingParams()
        request_id = request_id or f"req-{next(self._request_ids)}"
        stream = self._submit(request_id, prompt, params)
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

    def _submit(
        self, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> asyncio.Queue[RequestOutput | BaseException]:
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        text, ids = encode_prompt(self.tokenizer, prompt)
        check_prompt(ids, self.config.model.vocab_size, self.config.scheduler.max_model_len)
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        for child_id, child_params in self.processor.add_request(request_id, text, ids, params):
            self.client.add_request(
                EngineCoreRequest(
                    child_id, ids, child_params, self.tokenizer.eos_token_id, time.monotonic()
                )
            )
        return stream

    async def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests; their streams end with finish_reason "abort"."""
        self._start()
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        children = [child for rid in ids for child in self.processor.child_ids(rid)]
        self.client.abort_requests(children)

    # -- control --------------------------------------------------------------------------
    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause as DESIGN §3: returns once the mode's condition holds and every output
        produced before it has reached its stream. Invalid mode: ValueError, no change."""
        check_pause_mode(mode)
        if not isinstance(clear_cache, bool):
            raise ValueError(f"clear_cache: must be a boolean, got {clear_cache!r}")
        await self._call("pause", mode, clear_cache)

    async def resume_generation(self) -> None:
        await self._call("resume")

    async def is_paused(self) -> bool:
        return await self._call("is_paused")

    async def reset_prefix_cache(self) -> int:
        return await self._call("reset_prefix_cache")

    async def update_weight_version(self, label: str) -> dict[str, Any]:
        """Commit a new weight version (+1) labelled `label`; returns {version, label}."""
        return await self._call("update_weight_version", label)

    async def get_weight_version(self) -> dict[str, Any]:
        return await self._call("get_weight_version")

    async def get_stats(self) -> dict[str, Any]:
        """Queue sizes, KV usage, pause state and weight version of the engine core."""
        return await self._call("get_stats")

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

    async def _call(self, method: str, *args: Any) -> Any:
        self._start()
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        self.client.call_utility(UtilityCall(call_id, method, list(args)))
        return await future

    def _from_engine(self, batch: EngineCoreOutputs) -> None:
        """Runs on the client's thread: hand the batch to the event loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._handle_batch, batch)

    def _handle_batch(self, batch: EngineCoreOutputs) -> None:
        if batch.engine_error is not None:
            self._fail_all(EngineDeadError(f"engine core died:\n{batch.engine_error}"))
            return
        outputs, to_abort = self.processor.process(batch.outputs)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
        self.client.abort_requests(to_abort)
        for result in batch.results:
            future = self._calls.pop(result.call_id, None)
            if future is None or future.done():
                continue
            if result.error is None:
                future.set_result(result.result)
            elif result.error_type in ("ValueError", "TypeError"):
                future.set_exception(ValueError(result.error))
            else:
                future.set_exception(RuntimeError(result.error))

    def _fail_all(self, error: BaseException) -> None:
        self._dead = error
        for stream in self._streams.values():
            stream.put_nowait(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
