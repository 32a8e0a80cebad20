"""Model classes keyed by the Hugging Face architecture name in config.json."""

from torch import nn

from hotswap.model.models.llama import LlamaForCausalLM
from hotswap.model.models.moe import (
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from hotswap.model.models.qwen2 import Qwen2ForCausalLM
from hotswap.model.models.qwen2_vl import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)
from hotswap.model.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture: {architecture!r} is not supported; supported: "
            f"{', '.join(sorted(MODEL_REGISTRY))}"
        ) from None
