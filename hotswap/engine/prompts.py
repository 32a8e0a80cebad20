"""Prompt normalisation and validation shared by the front-ends (LLM, AsyncLLM)."""

from __future__ import annotations

from typing import Any

from hotswap.config import EngineConfig
from hotswap.engine.images import image_msgs
from hotswap.engine.messages import ImageMsg
from hotswap.errors import InvalidArgument
from hotswap.multimodal.prompt_images import PromptImages, prompt_images
from hotswap.sampling_params import SamplingParams, resolve_bad_words
from hotswap.structured_output import check_grammar
from hotswap.tokenizer import Tokenizer

# A prompt: text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}, either dict
# optionally with vLLM's "cache_salt".
Prompt = str | list[int] | dict[str, Any]


def prompt_cache_salt(prompt: Prompt) -> str | None:
    """vLLM's per-request prefix-cache salt: requests share cached KV only with requests
    of the same salt (None shares with other unsalted requests)."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidArgument("cache_salt", f"cache_salt: must be a non-empty string, got {salt!r}")
    return salt


def encode_prompt(tokenizer: Tokenizer, prompt: Prompt) -> tuple[str | None, list[int]]:
    """(text or None, token ids)."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return encode_prompt(tokenizer, prompt["prompt"])
        raise InvalidArgument(
            "prompt", "prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'"
        )
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return None, list(prompt)
    raise InvalidArgument("prompt", f"prompt: unsupported type {type(prompt).__name__}")


def encode_with_images(
    tokenizer: Tokenizer, images: PromptImages | None, prompt: Prompt
) -> tuple[str | None, list[int], list[ImageMsg] | None]:
    """(text or None, token ids with image placeholders expanded, the images in wire
    form or None): `encode_prompt` for a prompt that may carry `multi_modal_data`."""
    text, ids = encode_prompt(tokenizer, prompt)
    sources = prompt_images(prompt)
    if not sources:
        return text, ids, None
    if images is None:
        raise InvalidArgument("multi_modal_data", "multi_modal_data: this model does not "
                              "take images")  # fmt: skip
    ids, placed = images.place(ids, sources)
    return text, ids, image_msgs(placed)


def check_prompt(ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Raise ValueError naming the problem; changes nothing."""
    if not ids:
        raise InvalidArgument("prompt", "prompt: must contain at least one token")
    bad = next((t for t in ids if not (_is_int(t) and 0 <= t < vocab_size)), None)
    if bad is not None:
        raise InvalidArgument(
            "prompt_token_ids",
            f"prompt_token_ids: token id {bad!r} is outside the vocabulary "
            f"(integers 0..{vocab_size - 1})",
        )
    if len(ids) >= max_model_len:
        raise InvalidArgument(
            "prompt",
            f"prompt: {len(ids)} tokens is too long for max_model_len={max_model_len} "
            f"(at least one token must fit after it)",
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_priority(priority: object) -> int:
    """A request's scheduling priority (vLLM's: any int64; lower first under
    --scheduling-policy priority, accepted and unused under fcfs, as vLLM's v1 engine)."""
    if not (_is_int(priority) and -(2**63) <= priority < 2**63):  # type: ignore[operator]
        raise InvalidArgument("priority", f"priority: must be a 64-bit integer, got {priority!r}")
    return priority  # type: ignore[return-value]


MAX_KV_RETENTION_S = 3600.0  # an hour: a tool call, not a cache policy
MAX_SESSION_ID_CHARS = 256  # a session key is a name, not a payload


def is_session_id(value: object) -> bool:
    """A session key: a non-empty string of at most MAX_SESSION_ID_CHARS characters. The
    one rule, checked by the engine and by every place a request names one (each with its
    own message: a header's, a body field's)."""
    return isinstance(value, str) and 0 < len(value) <= MAX_SESSION_ID_CHARS


def check_kv_retention(seconds: object) -> float:
    """How long a finished request's KV is kept for its session's next turn (kv_cache.py);
    0 keeps nothing beyond the prefix cache's own LRU."""
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not (0 <= seconds <= MAX_KV_RETENTION_S)
    ):
        raise InvalidArgument("kv_retention_s", f"kv_retention_s: must be a number of seconds "
                              f"in [0, {MAX_KV_RETENTION_S:g}], got {seconds!r}")  # fmt: skip
    return float(seconds)


def prepare_params(params: SamplingParams, tokenizer: Tokenizer, config: EngineConfig) -> None:
    """The front-end's checks and derivations of a request's sampling params, before the
    engine sees them: token ids in the vocabulary, what the engine was started to return,
    bad words as token sequences, the structured-output constraint compilable
    (InvalidArgument naming the field)."""
    params.check_token_ids(config.model.vocab_size)
    params.check_engine_keeps_bf16(config.bf16_logprobs)
    resolve_bad_words(params, tokenizer)
    if params.structured_outputs is not None:
        check_grammar(params.structured_outputs)
