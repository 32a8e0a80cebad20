"""LoRA under data parallelism: a load reaches every engine core, and one core's refusal
aborts it on all (two phases: every core checks and holds the adapter, then all serve it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hotswap import LLM, AsyncLLM, LoRARequest, SamplingParams
from tests.helpers.tiny_models import write_peft_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [f"request {i} of a data-parallel batch" for i in range(6)]
ENGINE = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, enable_lora=True,
              max_lora_rank=16, max_cpu_loras=1)  # fmt: skip


async def final(llm: AsyncLLM, i: int, lora: LoRARequest):  # noqa: ANN201
    outs = [o async for o in llm.generate(PROMPTS[i], GREEDY, f"r{i}-{lora.lora_name}", lora)]
    return outs[-1].outputs[0]


async def generate(llm: AsyncLLM, i: int, lora: LoRARequest) -> list[int]:
    return (await final(llm, i, lora)).token_ids


@pytest.mark.slow
def test_a_load_reaches_every_rank_and_a_refusal_aborts_it_on_all(
    tiny_llama: Path, tmp_path: Path
) -> None:
    path_a = write_peft_adapter(tiny_llama, tmp_path / "a", 8, ("q_proj", "v_proj"), seed=1)
    path_b = write_peft_adapter(tiny_llama, tmp_path / "b", 8, ("o_proj",), seed=2)
    single = LLM(str(tiny_llama), progress=False, **ENGINE)
    adapter_a = LoRARequest("a", 1, str(path_a))
    expected = [
        o.outputs[0].token_ids
        for o in single.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=adapter_a)
    ]

    async def scenario() -> None:
        llm = AsyncLLM(str(tiny_llama), multiprocess=True, data_parallel_size=2, progress=False,
                       **ENGINE)  # fmt: skip
        try:
            await llm.load_lora_adapter("a", str(path_a))
            by_name = LoRARequest("a", 1)  # no path: the loaded one, on whichever rank
            got = await asyncio.gather(*(generate(llm, i, by_name) for i in range(6)))
            assert list(got) == expected
            assert all(count > 0 for count in llm.client.routed)  # both ranks served
            # A long request holds "a" on one rank: with --max-cpu-loras 1 that rank cannot
            # make room for "b", the other could; the load must fail on both.
            long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            held = llm.generate(PROMPTS[0], long, "long", by_name)
            await held.__anext__()
            with pytest.raises(Exception, match="in use"):
                await llm.load_lora_adapter("b", str(path_b))
            # no rank serves "b" (a request naming it is refused where it lands)
            results = await asyncio.gather(*(final(llm, i, LoRARequest("b", 2)) for i in range(4)))
            assert all(r.finish_reason == "abort" and "no adapter named 'b'" in r.stop_reason
                       for r in results), results  # fmt: skip
            await held.aclose()
            got = await asyncio.gather(*(generate(llm, i, by_name) for i in range(6)))
            assert list(got) == expected
        finally:
            llm.shutdown()

    asyncio.run(scenario())
