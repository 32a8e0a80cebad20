"""`LLM`: the blocking, offline front door (batch in, finished outputs back)."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm import tqdm

from hotswap.engine.core import EngineCore
from hotswap.engine.errors import EngineDeadError, InvalidArgument
from hotswap.engine.messages import EngineCoreRequest, ImageMsg
from hotswap.engine.output_processor import OutputProcessor
from hotswap.engine.prompts import (
    Prompt,
    check_priority,
    encode_with_images,
    prepare_params,
    prompt_cache_salt,
)
from hotswap.engine.verb_methods import with_verb_methods
from hotswap.engine.verbs import Args, CollectiveRpc, LoadWeightsInline, make_args
from hotswap.engine_args import EngineArgs
from hotswap.execution.host_memory import return_freed_memory
from hotswap.lora.loaded import LoadedAdapters
from hotswap.lora.request import LoRARequest
from hotswap.multimodal.prompt_images import PromptImages
from hotswap.outputs import RequestOutput
from hotswap.sampling_params import RequestOutputKind, SamplingParams
from hotswap.tokenizer import Tokenizer
from hotswap.weight_transfer.inline import inline_tensors

Message = dict[str, Any]


class _ShutDown:
    """An LLM's engine after `shutdown`: any use is refused."""

    def __getattr__(self, name: str) -> Any:
        raise EngineDeadError("LLM was shut down")


@with_verb_methods(coroutine=False)
class LLM:
    """Offline generation, and a method per control verb (verb_methods.py: `sleep`,
    `finish_weight_update`, ...; their parameters are the verbs' arguments), run between
    two `generate` calls, besides the few written out below."""

    def __init__(
        self, model: str | None = None, *, progress: bool = True, **engine_args: Any
    ) -> None:
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM: unknown engine argument(s) {sorted(unknown)}")
        args = EngineArgs(model=model, **engine_args)
        if args.data_parallel_size != 1:
            raise ValueError(
                "data_parallel_size: LLM runs one engine core; use AsyncLLM(multiprocess=True, "
                "data_parallel_size=N) or hotswap serve --data-parallel-size N"
            )
        if args.data_parallel_backend != "mp":
            raise ValueError(
                "data_parallel_backend: LLM runs its engine core in this process; use "
                "AsyncLLM(multiprocess=True, data_parallel_backend='ray') or hotswap serve"
            )
        self.config = args.create_engine_config()
        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)
        self.tokenizer = Tokenizer.from_pretrained(self.config.tokenizer)
        self.engine = EngineCore(self.config, progress=progress)
        self.processor = OutputProcessor(self.tokenizer)
        self.images = PromptImages.for_model(self.config.model.path, self.config.model.hf_config,
                                             self.config.media)  # fmt: skip
        self._ids = itertools.count()
        self._loras = LoadedAdapters()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: the adapter every prompt runs on, or one per prompt (None: the
        base model); loaded when first named (vLLM's). `priority`: one per prompt (vLLM's;
        lower first under --scheduling-policy priority)."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(
            sampling_params, len(prompt_list), self.config.default_sampling
        )
        priorities = _as_priority_list(priority, len(prompt_list))
        loras = _as_lora_list(lora_request, len(prompt_list))
        for lora in {id(r): r for r in loras if r is not None}.values():
            self._ensure_loaded(lora)
        requests = [encode_with_images(self.tokenizer, self.images, p) for p in prompt_list]
        salts = [prompt_cache_salt(p) for p in prompt_list]
        names = [r.lora_name if r is not None else None for r in loras]
        for (_, ids, images), params, name in zip(requests, params_list, names):
            prepare_params(params, self.tokenizer, self.config)  # refuse bad
            self.engine.validate_request(  # input before adding any
                EngineCoreRequest("validate", ids, params, lora_name=name, images=images)
            )
        order = []
        for (text, ids, images), params, salt, name, rank in zip(
            requests, params_list, salts, names, priorities
        ):
            order.append(self._add(text, ids, params, salt, name, rank, images))
        return self._run(order, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = []
        for conversation in conversations:
            ids = self.tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                **(chat_template_kwargs or {}),
            )
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # -- control verbs (verbs.py); the verbs' methods are `call` with their arguments ------
    def call(self, verb: str | type[Args], **arguments: Any) -> Any:
        """Invoke a control verb (its class, or its name) between two `generate` calls
        (nothing is in flight then, so a pause or sleep completes at once). Refused
        arguments raise InvalidArgument naming the field; outputs the verb produced are
        discarded (no request outlives `generate`)."""
        args = make_args(verb, arguments)
        result, _ = self.engine.run_now(args)
        self._loras.observe(args, result)
        return result

    def collective_rpc(
        self, method: str, args: tuple | list = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call `method` of the worker extension (`worker_extension_cls`): one result per
        tensor-parallel rank."""
        return self.call(CollectiveRpc, method=method, args=list(args), kwargs=kwargs or {})

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers and free its weights and KV cache
        (handing the freed heap back to the system: the engine keeps freed blocks for its
        steps, host_memory.py); the LLM serves nothing afterwards, and a second call does
        nothing. Without it, the workers are stopped at exit at the latest."""
        if isinstance(self.engine, _ShutDown):
            return
        self.engine.close()
        self.engine = _ShutDown()
        gc.collect()  # the engine's objects refer to each other
        return_freed_memory()

    # LoRA adapters: what the core holds is followed in `call`
    def _ensure_loaded(self, lora: LoRARequest) -> None:
        if self._loras.needs_load(lora):
            self.load_lora_adapter(lora.lora_name, lora.lora_path, load_inplace=True)

    # A body of its own: it turns tensors into the verb's inline form.
    def load_weights_inline(
        self,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        """Load these tensors by value (only they change); see AsyncLLM."""
        return self.call(
            LoadWeightsInline, tensors=inline_tensors(tensors), weight_version=weight_version
        )

    # -- internals ------------------------------------------------------------------------
    def _add(
        self,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        salt: str | None,
        lora_name: str | None = None,
        priority: int = 0,
        images: list[ImageMsg] | None = None,
    ) -> str:
        request_id = str(next(self._ids))
        params = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        for child_id, child_params in self.processor.add_request(request_id, text, ids, params):
            self.engine.add_request(
                EngineCoreRequest(
                    child_id,
                    ids,
                    child_params,
                    eos_token_id=self.tokenizer.eos_token_id,
                    cache_salt=salt,
                    lora_name=lora_name,
                    priority=priority,
                    images=images,
                )
            )
        return request_id

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(order), desc="Generating", unit="req", disable=not use_tqdm or len(order) < 2
        )
        while self.engine.has_unfinished_requests():
            done = self.processor.process(self.engine.step())
            self.engine.abort_requests(done.to_abort)
            # the final outputs of these still carry their bf16 logprobs
            outputs = done.outputs + self.processor.process(
                self.engine.abort_requests(done.to_stop, stopped=True)).outputs  # fmt: skip
            for out in outputs:
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[request_id] for request_id in order]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None,
    count: int,
    defaults: dict | None = None,
) -> list[SamplingParams]:
    """One params per prompt; none given: the model's defaults (generation_config), as
    vLLM's LLM.get_default_sampling_params."""
    if params is None:
        return [SamplingParams(**(defaults or {})) for _ in range(count)]
    return _per_prompt(params, count, "sampling_params", SamplingParams)


def _as_lora_list(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    return [None] * count if lora is None else _per_prompt(lora, count, "lora_request", LoRARequest)


def _as_priority_list(priority: Sequence[int] | None, count: int) -> list[int]:
    """vLLM's: None (all 0) or a list with one priority per prompt."""
    if priority is None:
        return [0] * count
    values = [priority] if isinstance(priority, int) else list(priority)
    if isinstance(priority, int) or len(values) != count:
        raise InvalidArgument("priority", f"priority: got {priority!r} for {count} prompts; "
                              "pass a list with one per prompt")  # fmt: skip
    return [check_priority(p) for p in values]


def _per_prompt(value: Any, count: int, field: str, single: type) -> list[Any]:
    """`value` for every prompt when it is one `single`, else one per prompt."""
    if isinstance(value, single):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(
            f"{field}: got {len(values)} for {count} prompts; pass one or one per prompt"
        )
    return values
