"""Requests, sampling parameters and outputs of the offline API."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field, replace


def check_utf8(text: str, what: str) -> str:
    """``text`` unchanged; ValueError named ``what`` when it holds a lone surrogate (no UTF-8 text
    holds one: the tokenizer and the constraints' byte automata cannot take it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what}: a string holds a lone surrogate ({e.object[e.start:e.end]!r}), which "
                         "no UTF-8 text holds") from None
    return text


def check_seed(seed: object, what: str, *, room: int = 0, optional: bool = False) -> None:
    """ValueError named ``what`` unless ``seed`` is an integer torch takes as a seed, with ``room`` more
    after it (seed + i for i < room) — past [-2**63, 2**64) torch fails with "Overflow when unpacking
    long long", naming nothing; ``optional``: None is taken too."""
    if optional and seed is None:
        return
    end = 2**64 - room
    if not isinstance(seed, int) or isinstance(seed, bool) or not -2**63 <= seed < end:
        span = f"[-2**63, 2**64{f' - {room}' if room else ''})" + (" or None" if optional else "")
        raise ValueError(f"{what}: expected an integer in {span}, got {seed!r}")


def check_top(top: object) -> int:
    """How many likeliest tokens to report per prompt token: an integer in [0, 20] (OpenAI's bound)."""
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20:
        raise ValueError(f"prompt_logprobs: expected an integer in [0, 20], got {top!r}")
    return top


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """vLLM's offline structured-output request, for code written against it
    (``SamplingParams(structured_outputs=StructuredOutputsParams(choice=[...]))``): one of ``json`` (a
    schema, or its JSON text), ``json_object``, ``regex``, ``choice``, ``grammar`` (GBNF or Lark) or
    ``structural_tag`` (its JSON text); SamplingParams reads it into its own ``json_schema`` / ``regex`` /
    ``choice`` / ``grammar`` / ``structural_tag``."""

    json: dict | bool | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    json_object: bool | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def fields(self) -> dict[str, object]:
        """The SamplingParams fields it stands for; ValueError for what is not served or not one."""
        asked = {name: getattr(self, name) for name in ("json", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, name) is not None}
        if self.json_object:
            asked["json_object"] = True
        if len(asked) != 1:
            raise ValueError("structured_outputs: expected exactly one of json, json_object, regex, choice, grammar, "
                             f"structural_tag, got {sorted(asked) or 'none'}")
        (name, value), = asked.items()
        if name == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: not JSON: {e}") from None
        return {"json": {"json_schema": value}, "json_object": {"json_schema": {"type": "object"}},
                "regex": {"regex": value}, "choice": {"choice": value}, "grammar": {"grammar": value},
                "structural_tag": {"structural_tag": value}}[name]


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """What to generate and how, with vLLM's names and meanings — except ``temperature``, greedy (0)
    unless asked (vLLM's default is 1.0; hypic's server follows OpenAI's 1.0), so a library call is
    reproducible by default — and ``max_tokens``, 16 by default (None: up to the model's context).
    Keyword arguments only (vLLM's first positional field is ``n``: ``SamplingParams(2)`` must not
    quietly mean two tokens here). Immutable: ``clone(**changes)`` makes a changed copy."""

    n: int = 1  # answers per prompt: answer i samples with seed + i when a seed is given (RequestOutput.outputs)
    max_tokens: int | None = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    # per generated token, its log-probability and the n likeliest (0: the sampled token's alone; None: off)
    logprobs: int | None = None
    # OpenAI's penalties over the tokens generated so far (the prompt's are not counted; vLLM does the same):
    # logit[t] − frequency_penalty · count[t] − presence_penalty · [count[t] > 0]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id → added to its logit at every step, in [-100, 100]
    # vLLM's extensions, with vLLM's meanings:
    top_k: int = 0  # sample among the k likeliest tokens only (0 or −1: all)
    min_p: float = 0.0  # drop tokens less likely than min_p × the likeliest one's probability
    # over the prompt's and the generated tokens: a positive logit divided by it, a negative multiplied
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the output like EOS (kept in token_ids, not in text)
    allowed_token_ids: tuple[int, ...] | None = None  # draw among these tokens only (None: all)
    # words never generated: each word's tokens (as written, and after a space) cannot be completed —
    # its last token is banned where the output ends with the ones before it (vLLM's meaning)
    bad_words: tuple[str, ...] = ()
    ignore_eos: bool = False  # EOS does not end the output (max_tokens or a stop token does)
    min_tokens: int = 0  # EOS and the stop tokens cannot be drawn before this many tokens
    # per prompt token, its log-probability and the n likeliest (None: off) — a full forward over the
    # prompt besides the mode's own (hypic.engine.scoring); RequestOutput.prompt_logprobs
    prompt_logprobs: int | None = None
    # structured output: the text generated is JSON this schema accepts (True: any JSON value;
    # OpenAI's json_object is {"type": "object"}); hypic.engine.structured says which keywords it enforces
    json_schema: dict | bool | None = None
    # vLLM's plain-text constraints: the whole text matches this regular expression (the subset
    # hypic.engine.structured.regex reads), or is exactly one of these strings
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    # vLLM's grammar constraint: the whole text derived from this grammar's start — GBNF's root
    # rule, or Lark's start (hypic.engine.structured.grammar, .lark)
    grammar: str | None = None
    # vLLM's structural tags: free text in which each trigger opens a tagged JSON structure (its JSON
    # text or the object: {"structures": [{"begin", "schema", "end"}], "triggers": [...]};
    # hypic.engine.structured.tags)
    structural_tag: str | dict | None = None
    # vLLM's object for the five above: read into them (and left None) as the params are made
    structured_outputs: StructuredOutputsParams | None = None
    # stop strings: the output ends where one first appears in its text (vLLM's meaning: the text ends
    # before it unless include_stop_str_in_output; the tokens generated so far are kept)
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # special tokens left out of the text (token_ids keep them)
    # vLLM's: only the prompt's last k tokens are read (-1: the longest prompt the context reads); a
    # prompt longer than the context is then taken (hypic.llm.cut_prompt)
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n: expected an integer ≥ 1, got {self.n!r}")
        for name in ("stop", "stop_token_ids", "bad_words"):  # vLLM's None for none
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            raise ValueError(f"max_tokens: expected an integer ≥ 1 or None, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature: expected a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        check_seed(self.seed, "seed", optional=True)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs: expected an integer in [0, 20] or None, got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}: expected a number in [-2, 2], got {value!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias: expected a mapping of token ids to numbers, got {self.logit_bias!r}")
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise ValueError(f"logit_bias: token ids must be non-negative integers, got {t!r}")
                if not isinstance(b, (int, float)) or isinstance(b, bool) or not -100.0 <= b <= 100.0:
                    raise ValueError(f"logit_bias: token {t}'s bias must be a number in [-100, 100], got {b!r}")

        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k: expected an integer ≥ −1 (0 or −1: off), got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: expected a number in [0, 1], got {self.min_p!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k == 0 or k < -1):
            raise ValueError(f"truncate_prompt_tokens: expected an integer ≥ 1, -1 or None, got {k!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or isinstance(rp, bool) or not 0.0 < rp <= 2.0:
            raise ValueError(f"repetition_penalty: expected a number in (0, 2], got {rp!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)) or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: expected non-negative integer token ids, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (tuple, list)) or not self.allowed_token_ids or any(
                    not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids: expected a non-empty list of non-negative token ids, got "
                                 f"{self.allowed_token_ids!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if not isinstance(self.bad_words, (tuple, list)) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words: expected a list of words (non-blank strings), got {self.bad_words!r}")
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        for word in self.bad_words:
            check_utf8(word, "bad_words")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: expected a boolean, got {self.ignore_eos!r}")
        if (not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0
                or (self.max_tokens is not None and self.min_tokens > self.max_tokens)):
            raise ValueError(f"min_tokens: expected an integer in [0, max_tokens = {self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop: expected a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        for text in self.stop:
            check_utf8(text, "stop")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a boolean, got {getattr(self, name)!r}")
        if self.prompt_logprobs is not None:
            check_top(self.prompt_logprobs)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs: expected a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
            for name, value in self.structured_outputs.fields().items():
                if self.constraint_kinds:
                    raise ValueError(f"structured_outputs: not with {self.constraint_kinds[0]}")
                object.__setattr__(self, name, value)
            object.__setattr__(self, "structured_outputs", None)  # read: a clone must not read it again
        if self.choice is not None:
            if not isinstance(self.choice, (tuple, list)) or not self.choice or any(
                    not isinstance(c, str) for c in self.choice):
                raise ValueError(f"choice: expected a non-empty list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
            for text in self.choice:
                check_utf8(text, "choice")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: expected a string, got {getattr(self, name)!r}")
        if self.grammar is not None:
            check_utf8(self.grammar, "grammar")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ValueError(f"structural_tag: expected its JSON text or an object, got {self.structural_tag!r}")
        kinds = self.constraint_kinds
        if len(kinds) > 1:
            raise ValueError(f"{kinds[1]}: one constraint at a time (with {kinds[0]})")
        if kinds:
            self.constraint()  # refused now, by name, not at the first step
            if self.allowed_token_ids is not None:
                raise ValueError(f"allowed_token_ids: not with {kinds[0]} (the grammar says what may be drawn)")
            for name in ("min_tokens", "ignore_eos"):  # the value's end is the output's end
                if getattr(self, name):
                    raise ValueError(f"{name}: not with {kinds[0]} (the constrained text's end ends the output)")

    @property
    def constraint_kinds(self) -> list[str]:
        """The structured-output fields given (at most one is valid)."""
        return [name for name in ("json_schema", "regex", "choice", "grammar", "structural_tag")
                if getattr(self, name) is not None]

    def constraint(self):  # -> hypic.engine.structured node, or None
        """The compiled grammar the output must follow (``hypic.engine.structured``), None when
        unconstrained; compiled once per schema, expression, choice list, grammar or tag set (cached)."""
        from hypic.engine.structured import compile_grammar, compile_schema, compile_tags, compile_text

        if self.json_schema is not None:
            return compile_schema(self.json_schema)
        if self.grammar is not None:
            return compile_grammar(self.grammar)
        if self.structural_tag is not None:
            return compile_tags(self.structural_tag)
        if self.regex is not None or self.choice is not None:
            return compile_text(self.regex, self.choice)
        return None

    def check_enders(self, eos: Collection[int]) -> None:
        """A ValueError when every allowed token would end the output before ``min_tokens`` may
        (the model's ``eos`` given): no token could be drawn."""
        if self.allowed_token_ids is None or not self.min_tokens:
            return
        enders = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos))
        if set(self.allowed_token_ids) <= enders:
            raise ValueError(f"allowed_token_ids: every allowed token ends the output (EOS or a stop token), which "
                             f"min_tokens forbids before {self.min_tokens} tokens: nothing could be drawn")

    def clone(self, **changes: object) -> SamplingParams:
        """A copy with ``changes`` (checked as a new one is)."""
        return replace(self, **changes)

    def for_choice(self, i: int) -> SamplingParams:
        """Answer ``i`` of ``n``: one answer, its own seed when a seed was given (wrapped into int64),
        the prompt scored (``prompt_logprobs``) by the first answer only — the server's choices are
        drawn the same way."""
        if i == 0:
            return self if self.n == 1 else replace(self, n=1)
        seed = None if self.seed is None else (self.seed + i + 2**63) % 2**64 - 2**63
        return replace(self, n=1, seed=seed, prompt_logprobs=None)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def filtered(self) -> bool:
        """Sampling keeps fewer than all tokens beyond top-p (top-k or min-p)."""
        return self.top_k > 0 or self.min_p > 0.0

    def stops_at(self, token: int, eos: set[int]) -> bool:
        """Whether drawing ``token`` ends the output."""
        return token in self.stop_token_ids or (token in eos and not self.ignore_eos)


@dataclass
class RequestMetrics:
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from entries that existed before this request
    recomputed_tokens: int = 0  # tokens run through the model for this prompt (cold prefill + combine)
    segment_hits: int = 0
    segment_misses: int = 0


@dataclass
class RequestOutput:
    """One prompt's answer. Its fields are vLLM's CompletionOutput's (``outputs[0]`` is the output
    itself, for code written against vLLM's RequestOutput; with ``n`` answers, ``outputs`` lists
    them, this one first) plus the prompt's and the cache's."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per generated token: top-n token → log-probability
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # "stop" | "length" once it ended ("cancelled" when its client left); None while it runs (vLLM's
    # meaning: a streamed delta's output is not finished)
    finish_reason: str | None = None
    # with SamplingParams.prompt_logprobs: per prompt token (None for the first), token → log-probability
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # what stopped it (vLLM's meaning): the stop string, a stop token's id, or None (EOS, the length)
    stop_reason: str | int | None = None
    prompt_token_ids: list[int] | None = None  # the prompt's tokens, segments joined (the offline API sets it)
    index: int = 0  # which of the prompt's n answers
    # the prompt as text (vLLM's): as given (segments joined by <<PIC_SEP>>), a chat's render; None for token ids
    prompt: str | None = None
    request_id: str | None = None  # the offline API numbers its prompts
    # the prompt's other answers (n > 1; not this one: an output holding itself could not be walked —
    # dataclasses.asdict recursed for ever)
    others: list[RequestOutput] = field(default_factory=list, repr=False, compare=False)

    @property
    def outputs(self) -> list[RequestOutput]:
        return [self, *self.others]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sampled tokens' log-probabilities summed (vLLM's); None without ``logprobs``."""
        if self.logprobs is None:
            return None
        return float(sum(top[t] for t, top in zip(self.token_ids, self.logprobs, strict=False) if t in top))
