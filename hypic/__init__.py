"""hypic: a serving engine for hybrid-attention LLMs with position-independent caching."""

__version__ = "0.1.0"
