"""The engine-side request: what a recompute forgets and what it keeps."""

from __future__ import annotations

import numpy as np

from hotswap.engine.request import Request
from hotswap.sampling_params import SamplingParams


def _request_with_rows(outputs: int) -> Request:
    request = Request("r", list(range(10)), SamplingParams(max_tokens=4))
    request.num_computed_tokens, request.block_ids = 8, [3]
    request.add_routed_experts(np.zeros((8, 2, 2), dtype=np.uint8))
    for token in range(outputs):
        request.append_output_token(100 + token)
    return request


def test_recompute_before_the_first_token_forgets_the_experts_read() -> None:
    """No token came from them: the recomputed positions' experts (maybe under newer
    weights) are the ones the first token comes from."""
    request = _request_with_rows(outputs=0)
    request.reset_for_recompute()
    assert request.num_computed_tokens == 0 and request.block_ids == []
    assert request.routed_experts == [] and request.routed_experts_start == 0


def test_recompute_after_a_token_keeps_the_experts_that_produced_it() -> None:
    request = _request_with_rows(outputs=1)
    request.reset_for_recompute()
    assert request.num_computed_tokens == 0 and request.block_ids == []
    assert len(request.routed_experts) == 1 and request.routed_experts_start == 8
