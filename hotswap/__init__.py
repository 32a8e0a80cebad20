"""hotswap: an LLM rollout engine for asynchronous RL."""

from hotswap.engine.async_llm import AsyncLLM, EngineDeadError
from hotswap.engine.llm import LLM
from hotswap.lora.request import LoRARequest
from hotswap.outputs import CompletionOutput, Logprob, RequestOutput, WeightVersionSpan
from hotswap.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineDeadError",
    "WeightVersionSpan",
    "CompletionOutput",
    "Logprob",
    "LoRARequest",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
__version__ = "0.1.0"
