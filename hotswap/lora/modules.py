"""LoRA adapters at the HTTP surface, shared by the vLLM and SGLang routes: the
`--lora-modules` flag (vLLM's), the checks a load makes before the engine's, and the
stable `lora_int_id` each adapter name gets.

The adapters a server serves are those loaded through its `AsyncLLM`
(`AsyncLLM.loaded_adapters`: name -> path); a request names one as `model` (vLLM) or
`lora_path` (SGLang's /generate)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hotswap.engine.errors import EngineStateError
from hotswap.errors import InvalidArgument

if TYPE_CHECKING:
    from hotswap.engine.async_llm import AsyncLLM

FLAG = "--lora-modules"


def already_loaded(name: str) -> str:
    """vLLM's refusal of a second load under a name without load_inplace."""
    return (
        f"The lora adapter '{name}' has already been loaded. If you want to load the "
        "adapter in place, set 'load_inplace' to True."
    )


def not_found(name: str) -> str:
    """vLLM's refusal of an unload (or a use) of a name not loaded."""
    return f"The lora adapter '{name}' cannot be found."


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry (vLLM's LoRAModulePath)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> tuple[LoRAModulePath, ...]:
    """`--lora-modules` values, as vLLM reads them: `name=path`, or a JSON object
    {"name", "path", "base_model_name"?}. Raises ValueError naming the flag."""
    modules = []
    for item in values or []:
        if not item:
            continue
        if "=" in item and not item.lstrip().startswith("{"):
            name, _, path = item.partition("=")
            modules.append(_module(item, {"name": name, "path": path}))
            continue
        try:
            fields = json.loads(item)
        except ValueError:
            raise ValueError(f"{FLAG}: invalid format {item!r}: expected name=path or a JSON "
                             "object with name, path and base_model_name") from None  # fmt: skip
        if not isinstance(fields, dict):
            raise ValueError(f"{FLAG}: {item!r} is not a JSON object")
        modules.append(_module(item, fields))
    names = [m.name for m in modules]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ValueError(f"{FLAG}: the name {duplicate!r} is given twice")
    return tuple(modules)


def _module(item: str, fields: dict[str, Any]) -> LoRAModulePath:
    unknown = sorted(set(fields) - {"name", "path", "base_model_name"})
    if unknown:
        raise ValueError(f"{FLAG}: {item!r}: unknown field {unknown[0]!r}")
    for key in ("name", "path"):
        if not isinstance(fields.get(key), str) or not fields[key]:
            raise ValueError(f"{FLAG}: {item!r}: '{key}' must be a non-empty string")
    base = fields.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"{FLAG}: {item!r}: 'base_model_name' must be a string")
    return LoRAModulePath(fields["name"], fields["path"], base)


class AdapterIds:
    """A stable `lora_int_id` per adapter name for the server's lifetime (vLLM keeps an
    adapter's id across in-place reloads; hotswap's engine keys adapters by name)."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._next = itertools.count(1)

    def of(self, name: str) -> int:
        if name not in self._ids:
            self._ids[name] = next(self._next)
        return self._ids[name]


async def load_adapter(
    engine: AsyncLLM, served_model_name: str, name: str, path: str, load_inplace: bool
) -> dict[str, Any]:
    """Load `path` under `name` through the engine, after vLLM's front-end checks (a
    name already loaded needs load_inplace). Refusals are InvalidArgument naming
    `lora_name` or `lora_path`; EngineStateError when LoRA is off or every slot is busy."""
    if "\x00" in path:  # the file system would refuse it without naming the field
        raise InvalidArgument("lora_path", "lora_path: must not contain a NUL character")
    if name == served_model_name:
        raise InvalidArgument("lora_name", f"lora_name: {name!r} is the served model's name")
    if not load_inplace and name in engine.loaded_adapters:
        raise InvalidArgument("lora_name", already_loaded(name))
    return await engine.load_lora_adapter(name, path, load_inplace)


async def load_lora_modules(
    engine: AsyncLLM, served_model_name: str, modules: tuple[LoRAModulePath, ...]
) -> None:
    """Load the `--lora-modules` adapters before the server accepts requests; a failure
    is a ValueError naming the flag and the adapter (the server does not start)."""
    for module in modules:
        try:
            await load_adapter(engine, served_model_name, module.name, module.path, False)
        except (InvalidArgument, EngineStateError) as e:
            raise ValueError(
                f"{FLAG}: cannot load {module.name!r} from {module.path!r}: {e}"
            ) from None
