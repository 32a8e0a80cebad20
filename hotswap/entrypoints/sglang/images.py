"""SGLang's `image_data` on /generate: the images of each prompt, as slime and verl send
them for vision-language rollouts (a URL, a data URL, a file path or bare base64; one
string or a list per prompt, a list of those for a batch). Loaded under the server's
media rules and placed as on vLLM's routes (placeholders expanded once)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from hotswap.engine.async_llm import AsyncLLM
from hotswap.entrypoints.openai.params import EnginePrompt, place_images
from hotswap.entrypoints.server.errors import bad_request

FIELD = "image_data"


def with_images(engine: AsyncLLM, prompts: list[EnginePrompt], value: Any,
                single: bool) -> list[EnginePrompt]:  # fmt: skip
    """`prompts` with their `image_data` placed (400 naming the element when refused)."""
    per_prompt = _per_prompt(value, len(prompts), single)
    if engine.images is None and any(per_prompt):
        raise bad_request(f"{FIELD}: this model does not take images", f"body.{FIELD}")
    placed = []
    for i, (prompt, images) in enumerate(zip(prompts, per_prompt)):
        if not images:
            placed.append(prompt)
            continue
        base = FIELD if single else f"{FIELD}[{i}]"
        sources = [(f"{base}[{j}]", _source(image, f"{base}[{j}]"))
                   for j, image in enumerate(images)]  # fmt: skip
        placed.append(place_images(engine, prompt, sources, base))
    return placed


def _per_prompt(value: Any, count: int, single: bool) -> list[list[Any]]:
    if value is None or value == []:
        return [[] for _ in range(count)]
    if single:
        return [value if isinstance(value, list) else [value]]
    if not isinstance(value, list) or len(value) != count:
        raise bad_request(f"{FIELD}: must be a list of {count} (one per prompt)", f"body.{FIELD}")
    return [[] if v is None else v if isinstance(v, list) else [v] for v in value]


def _source(image: Any, field: str) -> str | bytes:
    """A URL as it is; a file path as a file:// URL (the media rules then apply); anything
    else must be base64, as SGLang takes it."""
    if not isinstance(image, str) or not image:
        raise bad_request(f"{field}: must be a non-empty string", f"body.{field}")
    if image.startswith(("data:", "http://", "https://", "file://")):
        return image
    if image.startswith("/"):
        return "file://" + image
    try:
        return base64.b64decode(image, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{field}: not a URL, a file path or base64", f"body.{field}") from None
