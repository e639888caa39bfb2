"""Requests, sampling parameters and outputs of the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int = 0  # top-n log-probabilities of every generated token
    # OpenAI's penalties over the tokens generated so far (the prompt's are not counted; vLLM does the same):
    # logit[t] − frequency_penalty · count[t] − presence_penalty · [count[t] > 0]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id → added to its logit at every step, in [-100, 100]

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an integer ≥ 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature: expected a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed: expected an integer or None, got {self.seed!r}")
        if not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs: expected an integer in [0, 20], got {self.logprobs!r}")
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

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


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
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per generated token: top-n token → log-probability
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    finish_reason: str = "length"  # "length" | "stop"
