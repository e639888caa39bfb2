"""Beam search over the engine's one-token steps (vLLM's ``LLM.beam_search``, its names and scoring).

Each step asks every live beam for its next token's 2·width likeliest continuations — one
``generate`` call of one token per beam, all prompts' beams together — and keeps, per prompt, the
``beam_width`` best by ``cum_logprob / len(tokens) ** length_penalty`` (``tokens``: the prompt's and
the beam's, as vLLM counts them; a final EOS not counted). A beam whose next token is EOS is
complete (unless ``ignore_eos``); after ``max_tokens`` steps the complete beams and the live ones
compete for the ``beam_width`` places returned.

A beam is its prompt with the tokens chosen so far appended to the prompt's last segment: the query
is always computed in its request's context, so the documents before it stay cached once (``hypic``:
each step recomputes the seams and the query with the beam's tokens, nothing else), and a beam's
tokens never become a cache entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from hypic.engine.request import SamplingParams

MAX_WIDTH = 10  # 2·width continuations per beam, and a step returns at most 20 log-probabilities


@dataclass(frozen=True, kw_only=True)
class BeamSearchParams:
    """vLLM's: ``beam_width`` beams kept, ``max_tokens`` steps. ``temperature`` must be 0: beams are
    scored by the model's log-probabilities, which a temperature would not change here."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name, top in (("beam_width", MAX_WIDTH), ("max_tokens", None)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (top and value > top):
                raise ValueError(f"{name}: expected an integer in [1, {top}], got {value!r}" if top else
                                 f"{name}: expected an integer ≥ 1, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a boolean, got {getattr(self, name)!r}")
        if self.temperature != 0.0:
            raise ValueError(f"temperature: beam search scores the model's log-probabilities; only 0 is taken, "
                             f"got {self.temperature!r}")
        penalty = self.length_penalty
        if not isinstance(penalty, (int, float)) or isinstance(penalty, bool) or not math.isfinite(penalty):
            raise ValueError(f"length_penalty: expected a finite number, got {penalty!r}")


@dataclass
class BeamSearchSequence:
    """A beam: ``tokens`` the prompt's then its own (vLLM's), each step's log-probabilities of the
    continuations it was offered, their sum for its own tokens; ``text`` (its own tokens) and
    ``finish_reason`` ("stop": it ended with EOS; "length") once returned."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def score(beam: BeamSearchSequence, eos: set[int], length_penalty: float) -> float:
    """vLLM's ranking: the summed log-probability over the length (prompt included, a final EOS not)."""
    n = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos else 0)
    return beam.cum_logprob / (n ** length_penalty)


class BeamSearch:
    """The search, step by step, for a caller that runs each step's requests itself (the library
    synchronously, the server through its scheduler): ``pending()`` are the prompts whose next-token
    log-probabilities (top ``asked.logprobs``) the next step needs, ``advance()`` takes them, and
    ``results()`` are the beams kept once ``done``."""

    def __init__(self, prompts: list[list[list[int]]], params: BeamSearchParams, eos: set[int]) -> None:
        self.prompts, self.params, self.eos = prompts, params, eos
        self.asked = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True)
        self._beams = [[BeamSearchSequence(_flat(p))] for p in prompts]
        self._lengths = [len(b[0].tokens) for b in self._beams]  # each prompt's tokens
        self._done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self._steps = 0

    @property
    def done(self) -> bool:
        return self._steps >= self.params.max_tokens or not any(self._beams)

    def _key(self, beam: BeamSearchSequence) -> float:
        return score(beam, self.eos, self.params.length_penalty)

    def pending(self) -> list[list[list[int]]]:
        """Every live beam of every prompt as a prompt of its own, prompt by prompt."""
        return [_extended(self.prompts[i], b, self._lengths[i]) for i, group in enumerate(self._beams) for b in group]

    def advance(self, offered: list[dict[int, float]]) -> None:
        """One step: ``offered`` — per pending prompt, its continuations' log-probabilities."""
        live = [(i, b) for i, group in enumerate(self._beams) for b in group]
        if len(offered) != len(live):
            raise ValueError(f"offered: expected one per pending prompt ({len(live)}), got {len(offered)}")
        grown: list[list[BeamSearchSequence]] = [[] for _ in self.prompts]
        for (i, beam), tops in zip(live, offered, strict=True):
            for token, logprob in tops.items():
                child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [tops], beam.cum_logprob + logprob)
                (self._done[i] if token in self.eos and not self.params.ignore_eos else grown[i]).append(child)
        self._beams = [sorted(g, key=self._key, reverse=True)[:self.params.beam_width] for g in grown]
        self._steps += 1

    def results(self) -> list[BeamSearchOutput]:
        """Per prompt, the complete and the live beams' best ``beam_width``, best first."""
        out = []
        for i, length in enumerate(self._lengths):
            ranked = sorted(self._done[i] + self._beams[i], key=self._key, reverse=True)[:self.params.beam_width]
            for b in ranked:
                ended = b.tokens[-1] in self.eos and not self.params.ignore_eos and len(b.tokens) > length
                b.finish_reason = "stop" if ended else "length"
            out.append(BeamSearchOutput(ranked))
        return out


def search(step: Callable[[list[list[list[int]]], SamplingParams], list[dict[int, float]]],
           prompts: list[list[list[int]]], params: BeamSearchParams, eos: set[int]) -> list[BeamSearchOutput]:
    """``step(prompts, params)``: each prompt's next-token log-probabilities (its top 2·width). Per
    prompt, the beams kept after ``params.max_tokens`` steps, best first."""
    beams = BeamSearch(prompts, params, eos)
    while not beams.done:
        beams.advance(step(beams.pending(), beams.asked))
    return beams.results()


def _flat(prompt: list[list[int]]) -> list[int]:
    return [t for s in prompt for t in s]


def _extended(prompt: list[list[int]], beam: BeamSearchSequence, prompt_len: int) -> list[list[int]]:
    """The beam as a prompt: its tokens after the prompt's last segment (computed in context)."""
    return [*prompt[:-1], prompt[-1] + beam.tokens[prompt_len:]]
