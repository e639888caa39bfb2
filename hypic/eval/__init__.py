"""Synthetic evaluation: the task suite, the RAG trace generator, metrics, and the tokenizer trained on them.

Quality must be measured on models small enough to train here, so the data is synthetic: fictional
worlds rendered as prompts of cacheable segments, scored like the published evaluation (EM/F1 for
QA, ROUGE-L for summaries).
"""

from hypic.eval.metrics import best_score, score
from hypic.eval.tasks import FAMILIES, Example, generate
from hypic.eval.trace import Trace, TraceRequest, generate_trace

__all__ = ["FAMILIES", "Example", "Trace", "TraceRequest", "best_score", "generate", "generate_trace", "score"]
