"""`EngineActor`: one `AsyncLLM` in a Ray actor.

A plain class (made remote with options by `launch_engines`, or with `ray.remote` by
hand). Ray runs an actor whose methods are coroutines on one event loop, which is the
loop the `AsyncLLM` serves from; its engine core runs on a thread of the actor's process,
so the `ray` weight backend's chunks reach it through memory (`transfer.deliver`).

Generation: `generate` answers the final output, `generate_stream` is a streaming
generator (`for ref in actor.generate_stream.remote(...)`); cancelling it
(`ray.cancel(generator)`) aborts the request and frees its KV cache. Control: every verb
of `hotswap.engine.verbs` through `call(verb, **arguments)`, and a method per verb, as on
`AsyncLLM` (so an `EngineGroup` of `RayEngineClient`s drives the weight-transfer phases
like any engine's)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import ray

from hotswap.engine.async_llm import AsyncLLM
from hotswap.engine.prompts import Prompt
from hotswap.engine.verb_methods import with_verb_methods
from hotswap.engine.verbs import Args
from hotswap.errors import InvalidArgument
from hotswap.lora.request import LoRARequest
from hotswap.outputs import RequestOutput
from hotswap.ray.transfer import OBJECT, RayObjectEngine, deliver
from hotswap.sampling_params import SamplingParams

# What an engine actor receives weights with unless told otherwise: the backend that works
# wherever Ray does (set `weight_transfer_config` for gloo, nccl or ipc).
DEFAULT_WEIGHT_TRANSFER = {"backend": RayObjectEngine.backend}


@with_verb_methods(coroutine=True)
class EngineActor:
    def __init__(self, model: str | None = None, engine_args: dict[str, Any] | None = None):
        args = dict(engine_args or {})
        if args.get("data_parallel_size", 1) != 1:
            raise InvalidArgument(
                "data_parallel_size",
                "data_parallel_size: an engine actor hosts one engine core; launch more actors",
            )
        args.setdefault("weight_transfer_config", DEFAULT_WEIGHT_TRANSFER)
        self.llm = AsyncLLM(model, progress=False, **args)

    async def ready(self) -> dict[str, Any]:
        """Where this engine runs and what it serves (starts the engine's front-end)."""
        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "actor_id": context.get_actor_id(),
            "pid": os.getpid(),
            "world_size": await self.llm.get_world_size(),
            "weights": await self.llm.get_weight_info(),
        }

    # -- generation -----------------------------------------------------------------------
    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutput:
        """The request's final output (on `lora_request`'s adapter, if given)."""
        final = None
        params = _params(sampling_params)
        async for output in self.llm.generate(prompt, params, request_id, lora_request):
            final = output  # cumulative outputs: the last one holds everything
        assert final is not None
        return final

    async def generate_many(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams | dict[str, Any] | list[Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Final outputs of several requests run together (batched by the scheduler), in
        order; `sampling_params` is one for all or one per prompt."""
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params]
        if len(params) not in (1, len(prompts)):
            raise InvalidArgument(
                "sampling_params", "sampling_params: one for all prompts or one per prompt"
            )
        params = params * len(prompts) if len(params) == 1 else params
        return await asyncio.gather(
            *(self.generate(p, s, None, lora_request) for p, s in zip(prompts, params))
        )

    async def generate_stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Each output as the engine produces it (a Ray streaming generator)."""
        params = _params(sampling_params)
        async for output in self.llm.generate(prompt, params, request_id, lora_request):
            yield output

    async def front_end_stats(self) -> dict[str, Any]:
        """Tokens and finished requests counted by this engine's front-end."""
        return self.llm.front_end_stats()

    async def abort(self, request_ids: str | list[str] | None = None) -> int:
        return await self.llm.abort(request_ids)

    # -- control --------------------------------------------------------------------------
    async def call(self, verb: str | type[Args], **arguments: Any) -> Any:
        """Any control verb, by its class or its name (pause, resume, sleep, ...); the
        verbs' methods (made by with_verb_methods) are this with their arguments."""
        return await self.llm.call(verb, **arguments)

    async def update_weights(self, update_info: dict[str, Any]) -> int:
        """One chunk. With the ray backend `update_info["object"]` is the chunk's
        ObjectRef: resolved here (without blocking the actor's loop) and handed over."""
        ref = update_info.get(OBJECT) if isinstance(update_info, dict) else None
        if not isinstance(ref, ray.ObjectRef):
            return await self.llm.update_weights(update_info)
        arrays = await ref
        if not isinstance(arrays, list):
            raise InvalidArgument(
                f"update_info.{OBJECT}", f"update_info.{OBJECT}: must hold a list of arrays"
            )
        with deliver(update_info, arrays) as info:
            return await self.llm.update_weights(info)

    # LoRA adapters (a group loads on every actor in two phases: RayEngineGroup)
    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, load_inplace: bool = False
    ) -> dict[str, Any]:
        return await self.llm.load_lora_adapter(lora_name, lora_path, load_inplace)

    def shutdown(self) -> None:
        self.llm.shutdown()


def _params(params: SamplingParams | dict[str, Any] | None) -> SamplingParams | None:
    if isinstance(params, dict):
        return SamplingParams(**params)
    return params
