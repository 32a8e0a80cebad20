"""Routing replay across a pause (keep) and a weight commit mid-request: the rows that
produced tokens of weight version 0 are the old weights' experts, the rest the new
weights', and the split falls where the tokens' versions change (row p produced the
token at p + 1)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from hotswap import AsyncLLM
from hotswap.outputs import CompletionOutput
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    InProcessWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from tests.execution.test_routed_experts import reference_experts
from tests.weight_transfer.conftest import free_port, trainer_model
from tests.weight_transfer.test_mid_flight_swap import (
    ENGINE,
    MAX_TOKENS,
    PROMPTS,
    swap_mid_flight,
)

# An engine and a gloo trainer: slow.
pytestmark = pytest.mark.slow


def test_each_row_is_from_the_weights_that_produced_its_token(tiny_model_factory) -> None:
    v1_dir, v2_dir = tiny_model_factory("qwen3_moe", seed=0), tiny_model_factory("qwen3_moe", 1)

    async def run() -> tuple[list[CompletionOutput], list[list[int]]]:
        llm = AsyncLLM(str(v1_dir), weight_transfer_config={"backend": "gloo"},
                       enable_return_routed_experts=True, **ENGINE)  # fmt: skip
        try:
            await llm.get_weight_version()
            info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)
            trainer = await asyncio.to_thread(
                WeightTransferTrainerFactory.trainer_init, info, InProcessWeightSyncClient(llm),
                ModuleSource(trainer_model(v2_dir)),
            )  # fmt: skip
            outputs = await swap_mid_flight(llm, trainer, clear_cache=True)
            return outputs, [llm.tokenizer.encode(p) for p in PROMPTS]
        finally:
            llm.shutdown()

    outputs, prompt_ids = asyncio.run(run())
    swapped = 0
    for output, ids in zip(outputs, prompt_ids):
        fed = ids + output.token_ids[:-1]
        rows = output.routed_experts
        assert rows.shape[0] == len(fed) == len(ids) + MAX_TOKENS - 1
        boundary = next((s.start for s in output.weight_versions if s.version == 1), None)
        split = len(fed) if boundary is None else len(ids) + boundary - 1
        swapped += boundary is not None
        np.testing.assert_array_equal(rows[:split], reference_experts(v1_dir, fed)[:split])
        # clear_cache: the new weights recomputed the context, so their experts hold for
        # the rest of the sequence as if it had run on them from the start
        np.testing.assert_array_equal(rows[split:], reference_experts(v2_dir, fed)[split:])
    assert swapped >= 7
