"""draftwise: a speculative-decoding inference engine."""
from draftwise.entrypoints.llm import LLM
from draftwise.sampling_params import SamplingParams
from draftwise.outputs import RequestOutput, CompletionOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
