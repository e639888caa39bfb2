"""The tokenizer of the tiny task models: byte-level BPE trained on the task suite itself.

The engine tokenizes every segment on its own, so the pre-tokenizer adds a leading space to
each text: a word then gets the same tokens at the start of a segment as inside one, and an
answer tokenized alone ("Quorvane" -> " Quorvane") is the very token run the document holds.
Byte-level BPE never splits across a space or punctuation, so that run is contiguous in the
document's tokens. The model is trained to follow the query with the answer and `<|end|>`.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hypic.eval.tasks import FAMILIES, Example, generate
from hypic.eval.trace import generate_trace

END_OF_TEXT = "<|endoftext|>"  # document separator and padding
END = "<|end|>"  # ends a generated answer; greedy decoding stops on it
SPECIAL_TOKENS = (END_OF_TEXT, END)


def corpus(examples_per_family: int, seeds: Iterable[int], difficulties: Iterable[float] = (0.0, 0.5, 1.0),
           trace_requests: int = 0) -> Iterator[str]:
    """Every segment and answer of the task suite (and optionally a trace pool) over many seeds."""
    difficulties = tuple(difficulties)
    for seed in seeds:
        for family in FAMILIES:
            for d in difficulties:
                for ex in generate(family, examples_per_family, seed, difficulty=d):
                    yield from ex.segments
                    yield ex.answer
        if trace_requests:
            trace = generate_trace(seed, num_requests=trace_requests)
            yield from trace.documents
            yield from (r.query for r in trace.requests)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


@dataclass(frozen=True)
class EncodedExample:
    segments: list[list[int]]  # each segment tokenized on its own; head first, query last
    target: list[int]  # the answer's tokens then <|end|>: what the model should generate


def encode_example(tok: Tokenizer, ex: Example) -> EncodedExample:
    """Token ids the way the engine sees them (per segment, no special tokens) plus the generation target."""
    segments = [tok.encode(s, add_special_tokens=False).ids for s in ex.segments]
    target = tok.encode(ex.answer, add_special_tokens=False).ids + [tok.token_to_id(END)]
    return EncodedExample(segments, target)
