"""Default sampling parameters from the model's `generation_config.json`, as vLLM takes
them (`--generation-config auto|vllm|DIR`, `--override-generation-config JSON`).

A request's own value always wins; then the model's default; then the neutral one
(temperature 1, top_p 1, ...). "auto" reads the model directory's file, "vllm" none (the
neutral defaults), a directory that directory's file; the override is applied on top.
Only the sampling keys vLLM reads are taken, and Hugging Face's `max_new_tokens` becomes
`max_tokens`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SAMPLING_KEYS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


def default_sampling(
    source: str, model_dir: Path, override: str | dict[str, Any] | None = None
) -> dict[str, Any]:
    """The non-neutral sampling defaults (SamplingParams' names); ValueError naming the
    flag for a missing directory or bad JSON."""
    config = {} if source == "vllm" else _read(model_dir if source == "auto" else Path(source))
    config.update(_override(override))
    found = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    return found


def _read(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise ValueError(f"generation_config: {str(directory)!r} is not a directory")
    path = directory / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"generation_config: {path} is not JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _override(value: str | dict[str, Any] | None) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"override_generation_config: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError("override_generation_config: must be a JSON object")
    return value
