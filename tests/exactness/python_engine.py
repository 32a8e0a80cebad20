"""The Python API side: a fresh `AsyncLLM` (engine core on a thread of this process) per
schedule, driven through its public methods, and the engine arguments both sides share."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from hotswap import AsyncLLM, LoRARequest, SamplingParams
from hotswap.outputs import CompletionOutput
from hotswap.weight_transfer import InProcessWeightSyncClient
from tests.exactness.check import Span
from tests.exactness.driver import ChoiceSoFar, Stream
from tests.exactness.schedule import EngineSpec, Submit
from tests.exactness.trainer import Trainer
from tests.exactness.weights import FP8_BLOCK, WeightBank

MAX_LORA_RANK = 8
MAX_LORAS = 2


def engine_args(spec: EngineSpec, root: Path) -> dict[str, Any]:
    """The engine's arguments (EngineArgs names): batch-invariant float32 always."""
    transfer = {
        "backend": spec.backend,
        "in_flight": spec.in_flight,
        "double_buffer": spec.double_buffer,
        "kv_policy": spec.kv_policy,
    }
    args: dict[str, Any] = dict(
        dtype="float32",
        batch_invariant=True,
        enforce_eager=True,  # compiled decode steps cost a compile per engine
        block_size=spec.block_size,
        num_kv_blocks=spec.num_kv_blocks,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=spec.max_model_len,
        enable_sleep_mode=True,
        weight_transfer_config=transfer,
        allowed_weight_dirs=[str(root)],
        scheduling_policy=spec.scheduling_policy,
    )
    if spec.moe:
        args["enable_return_routed_experts"] = True
    if spec.fp8:
        config = {"quant_method": "fp8", "weight_block_size": list(FP8_BLOCK)}
        args.update(quantization="fp8", hf_overrides={"quantization_config": config})
    if spec.kv_fp8:
        args["kv_cache_dtype"] = "fp8"
    if spec.lora:
        args.update(enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=MAX_LORA_RANK)
    return args


def sampling_params(request: Submit) -> SamplingParams:
    sampled = {"temperature": 1.0, "seed": request.seed} if request.seed is not None else {}
    return SamplingParams(
        **(sampled or {"temperature": 0.0}),
        max_tokens=request.max_tokens,
        n=request.n,
        stop=list(request.stop) or None,
        ignore_eos=request.ignore_eos,
        logprobs=0,
    )


class PythonEngine:
    def __init__(self, spec: EngineSpec, bank: WeightBank) -> None:
        self.spec, self.bank = spec, bank
        self.llm: AsyncLLM | None = None
        self.cached_tokens = 0  # prompt tokens served from the prefix cache

    async def start(self) -> int:
        model = self.bank.model_dir(self.spec.arch)
        self.llm = AsyncLLM(str(model), progress=False, **engine_args(self.spec, self.bank.root))
        self.eos_token_id = self.llm.tokenizer.eos_token_id
        self.trainer = Trainer(InProcessWeightSyncClient(self.llm), self.spec.backend)
        return await self.version()

    def submit(self, stream: Stream, adapter: tuple[str, int] | None) -> None:
        lora = None if adapter is None else LoRARequest(adapter[0], adapter[1] + 1)
        stream.task = asyncio.ensure_future(self._consume(stream, lora))

    async def _consume(self, stream: Stream, lora: LoRARequest | None) -> None:
        request = stream.request
        prompt = {"prompt_token_ids": list(request.prompt)}
        params = sampling_params(request)
        stream_ = self.llm.generate(prompt, params, request.key, lora_request=lora,
                                    priority=request.priority,
                                    kv_retention_s=request.kv_retention_s)  # fmt: skip
        async for out in stream_:
            for completion in out.outputs:
                stream.choices[completion.index] = _choice(completion)
        self.cached_tokens += out.num_cached_tokens

    def experts_expected(self, request: Submit) -> bool:
        return self.spec.moe

    async def pause(self, mode: str, clear_cache: bool) -> None:
        await self.llm.pause_generation(mode=mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def sleep(self, level: int, mode: str) -> None:
        await self.llm.sleep(level=level, mode=mode)

    async def wake(self) -> None:
        await self.llm.wake_up()

    async def load_adapter(self, name: str, path: Path, inplace: bool) -> None:
        await self.llm.load_lora_adapter(name, str(path), load_inplace=inplace)

    async def load_from_disk(self, path: Path, label: str) -> None:
        await self.llm.load_weights_from_disk(model_path=str(path), weight_version=label)

    async def relabel(self, label: str) -> None:
        await self.llm.update_weight_version(label=label)

    async def version(self) -> int:
        return (await self.llm.get_weight_version())["version"]

    async def counters(self) -> dict[str, int]:
        stats = await self.llm.get_stats()
        return {
            "preemptions": stats["num_preemptions"],
            "prefix-cache hits (tokens)": self.cached_tokens,
        }

    async def finish(self) -> None:
        await asyncio.to_thread(self.trainer.close)
        self.llm.shutdown()


def _choice(completion: CompletionOutput) -> ChoiceSoFar:
    tokens = list(completion.token_ids)
    logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs or [], tokens)]
    spans = [
        Span(s.version, s.start, s.end, s.stale, s.lora_name, s.lora_version)
        for s in completion.weight_versions
    ]
    return ChoiceSoFar(
        tokens,
        logprobs,
        spans,
        completion.finish_reason,
        completion.stop_reason,
        completion.text,
        completion.routed_experts,
    )
