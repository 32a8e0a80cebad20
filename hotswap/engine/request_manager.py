"""The engine core's requests: admitting them, aborting them, and turning one scheduled
batch into per-request outputs."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from hotswap.config import EngineConfig
from hotswap.engine.core_outputs import WeightVersion, finished_output, step_output
from hotswap.engine.handlers import Outputs, handles
from hotswap.engine.images import ImageModel
from hotswap.engine.messages import EngineCoreOutput, EngineCoreRequest
from hotswap.engine.prompts import check_prompt
from hotswap.engine.request import Request, RequestStatus
from hotswap.engine.scheduler import PauseState, Scheduler, SchedulerOutput
from hotswap.engine.scoring import Bf16Scorer
from hotswap.engine.verbs import ResetPrefixCache
from hotswap.errors import InvalidArgument
from hotswap.execution.runner import ModelRunner, RunnerOutput
from hotswap.lora.manager import LoRAManager
from hotswap.multimodal.placement import ImagePlacement
from hotswap.structured_output import LazyGrammarCompiler


class RequestManager:
    """Admits, aborts and advances the scheduler's requests.

    Invariants: a request is validated in full before the scheduler sees it, so a refused
    request changes nothing; every output is stamped with the committed `weights` as they
    are when it is made; an unpaused engine with waiting requests and nothing running can
    always admit one (KV capacity >= max_model_len, checked at start-up), so an empty
    batch there is a bug, raised, never a silent stall."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        runner: ModelRunner,
        weights: WeightVersion,
        loras: LoRAManager,
    ) -> None:
        self.config = config
        self.loras = loras
        self.scheduler = scheduler
        self.runner = runner
        self.weights = weights
        self.vocab_size = config.model.vocab_size
        self.image_model = ImageModel(config.model.hf_config)
        self.grammars = LazyGrammarCompiler(config.tokenizer or config.model.path, self.vocab_size)
        budget = config.scheduler.max_num_batched_tokens
        self.scorer = Bf16Scorer(runner, scheduler, budget, config.logprobs_mode)

    def validate(self, req: EngineCoreRequest) -> ImagePlacement | None:
        """Raise ValueError naming the problem; changes nothing. Returns the request's
        images as placed in its prompt (None without images)."""
        check_prompt(req.prompt_token_ids, self.vocab_size, self.config.scheduler.max_model_len)
        if req.request_id in self.scheduler.requests:
            raise InvalidArgument("request_id", f"request_id: {req.request_id!r} is already in use")
        req.sampling_params.check_token_ids(self.vocab_size)
        req.sampling_params.check_prompt_length(len(req.prompt_token_ids))
        req.sampling_params.check_engine_keeps_bf16(self.config.bf16_logprobs)
        if req.lora_name is not None:
            self.loras.resolve(req.lora_name, self.adapters_in_use())
        return self.image_model.placement(req.prompt_token_ids, req.images)

    def adapters_in_use(self) -> set[int]:
        """The adapter versions unfinished requests hold."""
        return {r.lora.uid for r in self.scheduler.requests.values() if r.lora is not None}

    def add(self, req: EngineCoreRequest) -> None:
        images = self.validate(req)
        request = Request(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.eos_token_id,
            req.arrival_time,
            req.cache_salt,
            req.priority,
            req.kv_retention_s,
            images,
        )
        request.lora = self.loras.resolve(req.lora_name, self.adapters_in_use())
        constraint = req.sampling_params.structured_outputs
        if constraint is not None:
            request.grammar = self.grammars.matcher(constraint, req.eos_token_id)
        self.scheduler.add_request(request)

    def abort(
        self,
        request_ids: Iterable[str],
        reasons: Mapping[str, str] | None = None,
        stopped: bool = False,
    ) -> list[EngineCoreOutput]:
        """Finish the requests as aborted (unknown ids are skipped); `reasons` gives the
        stop reason of each. Returns their final outputs. `stopped`: a stop string ended
        them in the front end, which awaits their bf16 logprobs if they asked."""
        aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        if stopped:
            self.scorer.score([r for r in aborted if r.sampling_params.return_bf16_logprobs])
        if reasons is not None:
            for request in aborted:
                request.stop_reason = reasons[request.request_id]
        return [finished_output(r, self.weights) for r in aborted]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> int:
        """Forget every cached prefix. With `reset_running_requests`, running requests
        also drop their KV and recompute it when next scheduled."""
        if reset_running_requests:
            self.scheduler.drop_running_kv()
        return self.scheduler.kv.reset_prefix_cache()

    @handles(ResetPrefixCache)
    def on_reset_prefix_cache(self, args: ResetPrefixCache, out: Outputs) -> int:
        return self.reset_prefix_cache(args.reset_running_requests)

    def run(self, plan: SchedulerOutput) -> list[EngineCoreOutput]:
        """Run one scheduled (non-empty) batch on the model; the outputs of the requests
        it advanced."""
        result = self.runner.execute(plan)
        for request_id, scored in result.prompt_logprobs.items():
            if (request := self.scheduler.requests.get(request_id)) is not None:
                request.prompt_logprobs.extend(scored)
        for request_id, rows in result.routed_experts.items():
            if (request := self.scheduler.requests.get(request_id)) is not None:
                request.add_routed_experts(rows)
        changed = self.scheduler.update_from_output(plan, result.sampled)
        self._score_bf16(changed, result)
        return [step_output(r, result, self.weights) for r in changed]

    def _score_bf16(self, changed: list[Request], result: RunnerOutput) -> None:
        """return_bf16_logprobs: keep each new token's sampled logprob, and score the
        requests that finished now with the bf16 weights (engine/scoring.py)."""
        finished = []
        for request in changed:
            if request.sampling_params.return_bf16_logprobs:
                entry = result.logprobs.get(request.request_id)
                request.sampled_logprobs.append(math.nan if entry is None else entry.token_logprob)
                if request.is_finished:
                    finished.append(request)
        self.scorer.score(finished)

    def check_not_stuck(self) -> None:
        """Called when a step scheduled nothing."""
        sched = self.scheduler
        if sched.pause_state == PauseState.UNPAUSED and sched.waiting and not sched.running:
            # KV capacity >= max_model_len guarantees an idle engine can always admit.
            raise RuntimeError(
                f"scheduler: {sched.num_waiting} waiting requests but none can be admitted "
                f"with {sched.kv.num_free_blocks} free blocks"
            )
