"""`LoRARequest`: which adapter a request runs on (vLLM's class, its names and fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hotswap.errors import InvalidArgument


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter by name and path. The engine loads it the first time it is named
    (and again when its path changes, or `load_inplace` is set); requests naming it then
    run on it. Without a path (""), it names an adapter the engine already holds (loaded
    before, or sent by a trainer's weight round). `lora_int_id` is vLLM's unique id."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidArgument("lora_request.lora_name", "lora_name: must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidArgument(
                "lora_request.lora_int_id",
                f"lora_int_id: must be an integer of at least 1, got {self.lora_int_id!r}",
            )
        if not isinstance(self.lora_path, str):
            raise InvalidArgument("lora_request.lora_path", "lora_path: must be a directory path")

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


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

    def observe(self, verb: str, arguments: Any, answer: Any) -> None:
        """Follow what a control call did to the cores' adapters: a load or commit, a
        weight round committed into an adapter (it has no path: it is named by name),
        an unload."""
        if verb == "load_lora_adapter" and arguments.prepare:
            return  # held aside: served only once committed
        if verb in ("load_lora_adapter", "commit_lora_adapter") and isinstance(answer, dict):
            self.loaded(answer["lora_name"], answer.get("lora_path") or "")
        elif verb == "finish_weight_update" and isinstance(answer, dict):
            if answer.get("lora_name") is not None:
                name = answer["lora_name"]
                self.loaded(name, self.by_name.get(name, ""))
        elif verb == "unload_lora_adapter":
            self.unloaded(arguments.lora_name)
