"""hypic: a serving engine for hybrid-attention LLMs with position-independent caching."""

from hypic.engine.request import RequestOutput, SamplingParams, StructuredOutputsParams
from hypic.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
