"""What an engine core emits for a request, and the committed weight version it stamps on
every output (so a trainer knows which weights produced which tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hotswap.engine.messages import EngineCoreOutput, RoutedExpertsMsg, TokenLogprobsMsg
from hotswap.engine.request import Request
from hotswap.execution.runner import RunnerOutput
from hotswap.execution.sampler import TokenLogprobs

DEFAULT_WEIGHT_LABEL = "default"


@dataclass
class WeightVersion:
    """The committed weights: `version` (+1 per commit, never goes back) and a free-form
    `label`. Written only by `WeightManager`; everything else reads it."""

    version: int = 0
    label: str = DEFAULT_WEIGHT_LABEL


def finished_output(request: Request, weights: WeightVersion) -> EngineCoreOutput:
    """The output carrying no new token: a request's finish (or its state so far)."""
    lora = request.lora
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        finish_reason=request.status.finish_reason,
        stop_reason=request.stop_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        weight_version=weights.version,
        weight_label=weights.label,
        # KV computed under older weights than the committed ones: the token is stale.
        stale=request.kv_version != weights.version,
        lora_name=lora.name if lora is not None else None,
        lora_version=lora.version if lora is not None else None,
        routed_experts=_take_routed_experts(request),
        bf16_logprobs=request.bf16_logprobs,  # set at the finish, when asked for
    )


def _take_routed_experts(request: Request) -> RoutedExpertsMsg | None:
    """The rows read since the last output, which now carries them."""
    if not request.routed_experts:
        return None
    rows = np.concatenate(request.routed_experts)
    request.routed_experts = []
    return RoutedExpertsMsg.of(rows)


def step_output(request: Request, result: RunnerOutput, weights: WeightVersion) -> EngineCoreOutput:
    """The output of one step for a request that got a token; its prompt logprobs ride
    on the first one only."""
    logprobs = result.logprobs.get(request.request_id)
    out = finished_output(request, weights)
    out.new_token_ids = [request.output_token_ids[-1]]
    if logprobs is not None and request.sampling_params.logprobs is not None:
        out.new_logprobs = [logprobs_msg(logprobs)]  # (return_bf16_logprobs also has them)
    if request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
        out.prompt_logprobs = [logprobs_msg(lp) for lp in request.prompt_logprobs]
        request.prompt_logprobs_sent = True
    return out


def logprobs_msg(logprobs: TokenLogprobs) -> TokenLogprobsMsg:
    return TokenLogprobsMsg(
        logprobs.token_logprob, logprobs.token_rank, logprobs.top_ids, logprobs.top_logprobs
    )
