"""`LoRARequest`: which adapter a request runs on (vLLM's class, its names and fields)."""

from __future__ import annotations

from dataclasses import dataclass

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
    # vLLM's marker of an adapter whose MoE weights are 3-D (peft's target_parameters on
    # the stacked experts); hotswap reads the adapter's own layout, so it changes nothing
    is_3d_lora_weight: bool = False

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
