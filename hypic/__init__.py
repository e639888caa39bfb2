"""hypic: a serving engine for hybrid-attention LLMs with position-independent caching."""

from hypic.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from hypic.engine.request import RequestOutput, SamplingParams, StructuredOutputsParams
from hypic.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
