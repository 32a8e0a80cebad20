"""SGLang's POST /generate request, checked and turned into engine jobs: one per prompt,
each with its own SamplingParams. Every refusal is a 400 naming the offending element
(`body.sampling_params[1].top_p`, `body.input_ids[0][3]`), before anything is submitted."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from hotswap.engine.async_llm import AsyncLLM
from hotswap.engine.prompts import is_session_id
from hotswap.entrypoints.openai.constraints import parse_logit_bias
from hotswap.entrypoints.openai.params import (
    EnginePrompt,
    adapter_request,
    check_unknown_fields,
    prepare_prompt,
)
from hotswap.entrypoints.server.default_only import absent, check_default_only, short_repr
from hotswap.entrypoints.server.errors import APIError, bad_request
from hotswap.entrypoints.server.limits import off_loop, printable_field
from hotswap.entrypoints.server.routing import Routing, request_routing
from hotswap.entrypoints.server.sampling import build_sampling_params
from hotswap.entrypoints.server.state import get_server_config
from hotswap.entrypoints.sglang.images import with_images
from hotswap.entrypoints.sglang.protocol import (
    DEFAULT_ONLY,
    MAX_RID_CHARS,
    SAMPLING_DEFAULT_ONLY,
    SGLANG_NAMES,
    GenerateRequest,
    SGLangSampling,
)
from hotswap.entrypoints.sglang.render import Job, LogprobSpec
from hotswap.errors import InvalidArgument
from hotswap.lora.request import LoRARequest
from hotswap.sampling_params import MAX_LOGPROBS, RequestOutputKind, StructuredOutputsParams
from hotswap.structured_output import check_grammar


async def plan_jobs(
    request: Request, body: GenerateRequest, engine: AsyncLLM
) -> tuple[list[Job], int, bool]:
    """(one job per prompt, samples per prompt n, whether the request is a single prompt)."""
    check_default_only(DEFAULT_ONLY, body)
    inputs, single = _inputs(body)
    samplings = _samplings(request, body.sampling_params, len(inputs))
    n = _common_n(samplings)
    rids = _rids(body.rid, len(inputs), single)
    salts = _per_prompt(body.cache_salt, len(inputs), "cache_salt", _is_salt, None)
    loras = _loras(request, body.lora_path, len(inputs))
    routes = _routings(request, body, len(inputs))
    prompts = await off_loop(  # tokenizing a long prompt must not stall other clients
        lambda: [prepare_prompt(engine, value, param=param) for value, param in inputs]
    )
    prompts = await off_loop(with_images, engine, prompts, body.image_data, single)
    specs = _logprob_specs(body, prompts)
    routed = _routed_experts(body, prompts)
    jobs = []
    for i, (prompt, (fields, prefix)) in enumerate(zip(prompts, samplings)):
        prompt.cache_salt, prompt.lora_request, prompt.routing = salts[i], loras[i], routes[i]
        jobs.append(_job(prompt, fields, prefix, specs[i], rids[i], body.stream))
        if routed[i] is not None:
            jobs[-1].routed_experts = True
            jobs[-1].params.routed_experts_prompt_start = routed[i]
        jobs[-1].params.return_bf16_logprobs = body.return_bf16_logprobs
    structured = get_server_config(request).structured_outputs  # the server's defaults
    for job in jobs:
        structured.apply(job.params.structured_outputs)
    return jobs, n, single


def _label(param: str) -> str:
    """A param without its root, as messages name fields (`sampling_params.n`)."""
    return param.removeprefix("body").lstrip(".")


def _inputs(body: GenerateRequest) -> tuple[list[tuple[str | list[int], str]], bool]:
    """[(prompt, its param)], and whether the request is a single prompt."""
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("text: give exactly one of 'text' or 'input_ids'", "body.text")
    if body.text is not None:
        if isinstance(body.text, str):
            return [(body.text, "body.text")], True
        if not isinstance(body.text, list) or not body.text:
            raise bad_request("text: must be a string or a non-empty list", "body.text")
        for i, text in enumerate(body.text):
            if not isinstance(text, str):
                raise bad_request(f"text[{i}]: must be a string", f"body.text[{i}]")
        return [(text, f"body.text[{i}]") for i, text in enumerate(body.text)], False
    ids = body.input_ids
    if not isinstance(ids, list) or not ids:
        raise bad_request("input_ids: must be a non-empty list", "body.input_ids")
    if not isinstance(ids[0], list):  # as SGLang: the first element decides
        _check_ids(ids, "input_ids")
        return [(ids, "body.input_ids")], True
    for i, prompt in enumerate(ids):
        if not isinstance(prompt, list):
            raise bad_request(
                f"input_ids[{i}]: must be a list of token ids", f"body.input_ids[{i}]"
            )
        _check_ids(prompt, f"input_ids[{i}]")
    return [(prompt, f"body.input_ids[{i}]") for i, prompt in enumerate(ids)], False


def _check_ids(ids: list[Any], field: str) -> None:
    for j, token in enumerate(ids):
        if type(token) is not int:  # bool and float are not token ids
            raise bad_request(f"{field}[{j}]: must be an integer token id", f"body.{field}[{j}]")


def _samplings(request: Request, value: Any, count: int) -> list[tuple[SGLangSampling, str]]:
    """One (checked sampling_params, its param prefix) per prompt."""
    if value is None or isinstance(value, dict):
        dicts, prefixes = [value or {}], ["body.sampling_params"]
    elif isinstance(value, list) and len(value) == count:
        dicts, prefixes = value, [f"body.sampling_params[{i}]" for i in range(count)]
    else:
        raise bad_request(
            f"sampling_params: must be an object or a list of {count} (one per prompt)",
            "body.sampling_params",
        )
    parsed, unknown, ignored = [], [], []
    for raw, prefix in zip(dicts, prefixes):
        if not isinstance(raw, dict):
            raise bad_request(f"{_label(prefix)}: must be an object", prefix)
        try:
            fields = SGLangSampling.model_validate(raw)
        except ValidationError as e:
            raise _validation_error(e, prefix) from None
        check_default_only(SAMPLING_DEFAULT_ONLY, fields, prefix)
        unknown += [f"{_label(prefix)}.{name}" for name in fields.unknown_fields]
        if not absent(fields.custom_params):
            ignored.append(f"{_label(prefix)}.custom_params")
        parsed.append((fields, prefix))
    # custom_params is only warned about: stock SGLang ignores it as well unless a custom
    # logit processor (refused here) reads it
    check_unknown_fields(request, unknown, ignored)
    return parsed * count if len(parsed) == 1 else parsed


def _validation_error(error: ValidationError, prefix: str) -> APIError:
    first = error.errors()[0]
    loc = first.get("loc") or ("",)
    name = printable_field(str(loc[0]))  # the field; union members add their own tags
    return bad_request(f"{_label(prefix)}.{name}: {first.get('msg')}", f"{prefix}.{name}")


def _common_n(samplings: list[tuple[SGLangSampling, str]]) -> int:
    ns = {fields.n or 1 for fields, _ in samplings}
    if len(ns) > 1:  # SGLang refuses it too: the list is expanded n times over
        raise bad_request(
            "sampling_params.n: must be the same for every prompt", "body.sampling_params"
        )
    return ns.pop()


def _rids(value: Any, count: int, single: bool) -> list[str]:
    """The engine request ids, SGLang's way: a string names a single prompt or prefixes a
    batch's (`{rid}_{i}`), a list names each prompt, none gives fresh ones."""
    if value is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(value, str) and single:
        rids = [value]
    elif isinstance(value, str):
        rids = [f"{value}_{i}" for i in range(count)]
    elif isinstance(value, list) and len(value) == count and all(isinstance(r, str) for r in value):
        rids = value
    else:
        raise bad_request(f"rid: must be a string or a list of {count} strings", "body.rid")
    if any(not 0 < len(r) <= MAX_RID_CHARS for r in rids):
        raise bad_request(f"rid: must be 1 to {MAX_RID_CHARS} characters", "body.rid")
    if len(set(rids)) != len(rids):
        raise bad_request("rid: duplicate request ids within the request", "body.rid")
    return rids


def _per_prompt(value: Any, count: int, name: str, ok: Any, default: Any) -> list[Any]:
    """A value for every prompt, or one per prompt (a list of `count`); each must pass
    `ok` (400 naming the element otherwise)."""
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise bad_request(f"{name}: a list must hold one value per prompt", f"body.{name}")
        params = [f"{name}[{i}]" for i in range(count)]
    else:
        value, params = [value] * count, [name] * count
    for item, param in zip(value, params):
        if not ok(item):
            raise bad_request(f"{param}: invalid value {short_repr(item)}", f"body.{param}")
    return [default if item is None else item for item in value]


def _loras(request: Request, value: Any, count: int) -> list[LoRARequest | None]:
    """`lora_path`: the adapter each prompt runs on, by the name it was loaded under
    (/load_lora_adapter, --lora-modules); null for the base model. A name not loaded is
    refused (SGLang's older form, a directory, is not loaded on the fly)."""
    names = _per_prompt(value, count, "lora_path", _is_salt, None)
    loras = []
    for i, name in enumerate(names):
        lora = None if name is None else adapter_request(request, name)
        if name is not None and lora is None:
            field = f"lora_path[{i}]" if isinstance(value, list) else "lora_path"
            raise bad_request(
                f"{field}: no LoRA adapter named {short_repr(name)} is loaded "
                "(load it with /load_lora_adapter)",
                f"body.{field}",
            )
        loras.append(lora)
    return loras


def _routings(request: Request, body: GenerateRequest, count: int) -> list[Routing]:
    """Per prompt, SGLang's routing_key (a session key) and data_parallel_rank (or its
    newer routed_dp_rank), under the headers' (server/routing.py)."""
    keys = _per_prompt(body.routing_key, count, "routing_key", _is_key, None)
    name = "routed_dp_rank" if body.routed_dp_rank is not None else "data_parallel_rank"
    ranks = _per_prompt(getattr(body, name), count, name, _is_int, None)
    return [request_routing(request, key, rank) for key, rank in zip(keys, ranks)]


def _is_key(value: Any) -> bool:
    return value is None or is_session_id(value)


def _is_salt(value: Any) -> bool:
    return value is None or (isinstance(value, str) and len(value) > 0)


def _is_bool(value: Any) -> bool:
    return value is None or isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return value is None or type(value) is int


def _routed_experts(body: GenerateRequest, prompts: list[EnginePrompt]) -> list[int | None]:
    """Per prompt: the first position whose experts return_routed_experts asks for
    (routed_experts_start_len, 0 to the prompt's length as SGLang checks), or None."""
    count = len(prompts)
    wanted = _per_prompt(body.return_routed_experts, count, "return_routed_experts",
                         _is_bool, False)  # fmt: skip
    starts = _per_prompt(body.routed_experts_start_len, count, "routed_experts_start_len",
                         _is_int, 0)  # fmt: skip
    found: list[int | None] = []
    for want, start, prompt in zip(wanted, starts, prompts):
        if want and not 0 <= start <= len(prompt.token_ids):
            raise bad_request(
                f"routed_experts_start_len: must be between 0 and the number of input "
                f"tokens ({len(prompt.token_ids)}), got {start}",
                "body.routed_experts_start_len",
            )
        found.append(start if want else None)
    return found


def _logprob_specs(body: GenerateRequest, prompts: list[EnginePrompt]) -> list[LogprobSpec | None]:
    """return_logprob, logprob_start_len and top_logprobs_num: one value or one per prompt."""
    count = len(prompts)
    wanted = _per_prompt(body.return_logprob, count, "return_logprob", _is_bool, False)
    starts = _per_prompt(body.logprob_start_len, count, "logprob_start_len", _is_int, -1)
    tops = _per_prompt(body.top_logprobs_num, count, "top_logprobs_num", _is_int, 0)
    specs: list[LogprobSpec | None] = []
    for prompt, want, start, top in zip(prompts, wanted, starts, tops):
        if not want:
            specs.append(None)
            continue
        if not 0 <= top <= MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs_num: must be in [0, {MAX_LOGPROBS}], got {top}",
                "body.top_logprobs_num",
            )
        last = len(prompt.token_ids) - 1
        if not -1 <= start <= last:  # SGLang refuses a start past the prompt too
            raise bad_request(
                f"logprob_start_len: must be -1 or a prompt position (0 to {last}), got {start}",
                "body.logprob_start_len",
            )
        specs.append(LogprobSpec(last if start == -1 else start, top, body.return_text_in_logprobs))
    return specs


def _job(
    prompt: EnginePrompt,
    fields: SGLangSampling,
    prefix: str,
    spec: LogprobSpec | None,
    rid: str,
    stream: bool,
) -> Job:
    """SGLang's sampling fields as SamplingParams; a refused value is a 400 naming it."""
    max_new = fields.max_new_tokens
    min_new = fields.min_new_tokens or 0
    if max_new is not None and min_new > max_new:
        raise bad_request(
            f"{_label(prefix)}.min_new_tokens: ({min_new}) must not exceed "
            f"max_new_tokens ({max_new})",
            f"{prefix}.min_new_tokens",
        )
    # Prompt scores from the second reported position on (the first is never scored).
    scored = spec is not None and spec.start < len(prompt.token_ids) - 1
    try:
        params = build_sampling_params(
            fields,
            names=SGLANG_NAMES,
            # max_new_tokens 0 scores the prompt: one token is sampled and dropped.
            # Past the context the engine stops with "length", as SGLang clamps.
            max_tokens=None if max_new is None else max(max_new, 1),
            logprobs=None if spec is None else spec.top,
            prompt_logprobs=spec.top if spec is not None and scored else None,
            logit_bias=parse_logit_bias(fields.logit_bias, f"{prefix}.logit_bias", None),
            structured_outputs=_constraint(fields, prefix),
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )
    except InvalidArgument as e:  # its field and message in SGLang's names already
        param = f"{prefix}.{e.field}" if e.field else prefix
        raise bad_request(f"{_label(prefix)}.{e}", param) from None
    return Job(prompt, params, rid, spec, max_new == 0, bool(fields.no_stop_trim))


_CONSTRAINTS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}


def _constraint(fields: SGLangSampling, prefix: str) -> StructuredOutputsParams | None:
    """SGLang's json_schema / regex / ebnf as one checked constraint (400 naming it)."""
    given = {name: getattr(fields, name) for name in _CONSTRAINTS if getattr(fields, name)}
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(
            f"{_label(prefix)}: only one of json_schema, regex and ebnf may be given",
            prefix,
        )
    ((name, value),) = given.items()
    params = StructuredOutputsParams(**{_CONSTRAINTS[name]: value})
    try:
        check_grammar(params)
    except InvalidArgument as e:
        raise bad_request(f"{_label(prefix)}.{name}: {e}", f"{prefix}.{name}") from None
    return params
