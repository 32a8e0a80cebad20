"""What a front-end (`LLM`, `AsyncLLM`) has loaded into its engine core(s), followed
from the control calls it makes."""

from __future__ import annotations

from typing import Any

from hotswap.engine.verbs import (
    Args,
    CommitLoraAdapter,
    FinishWeightUpdate,
    LoadLoraAdapter,
    UnloadLoraAdapter,
)
from hotswap.lora.request import LoRARequest


class LoadedAdapters:
    """What a front-end has loaded into its engine core(s): name -> path. A `LoRARequest`
    is loaded only when the cores may not hold it yet (first use, a new path, or
    `load_inplace`)."""

    def __init__(self) -> None:
        self.by_name: dict[str, str] = {}

    def needs_load(self, request: LoRARequest) -> bool:
        if not request.lora_path:
            return False  # the engine's own (pushed by a trainer, or loaded by name)
        return request.load_inplace or self.by_name.get(request.lora_name) != request.lora_path

    def loaded(self, name: str, path: str) -> None:
        self.by_name[name] = path

    def unloaded(self, name: str) -> None:
        self.by_name.pop(name, None)

    def observe(self, args: Args, answer: Any) -> None:
        """Follow what a control call did to the cores' adapters: a load or commit, a
        weight round committed into an adapter (it has no path: it is named by name),
        an unload."""
        if isinstance(args, LoadLoraAdapter) and args.prepare:
            return  # held aside: served only once committed
        if isinstance(args, (LoadLoraAdapter, CommitLoraAdapter)) and isinstance(answer, dict):
            self.loaded(answer["lora_name"], answer.get("lora_path") or "")
        elif isinstance(args, FinishWeightUpdate) and isinstance(answer, dict):
            if answer.get("lora_name") is not None:
                name = answer["lora_name"]
                self.loaded(name, self.by_name.get(name, ""))
        elif isinstance(args, UnloadLoraAdapter):
            self.unloaded(args.lora_name)
