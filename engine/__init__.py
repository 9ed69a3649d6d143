"""pagedserve's engine: model loading, paged model runner, sampler and the engines.

The offline API mirrors vLLM's: `from engine import LLM, SamplingParams`.
"""

from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "TokenLogprobs"]
