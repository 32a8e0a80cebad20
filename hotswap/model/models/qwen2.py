"""Qwen2: the Llama decoder with biases on the q/k/v projections (none on o_proj)."""

from hotswap.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False
