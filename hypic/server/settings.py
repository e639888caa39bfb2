"""Server settings: the limits that keep one client from starving the others, validated up front.

The model's own limits (its position budget, its cache budgets, the seam) live on the ``LLM``;
these are the serving limits a deployment tunes per endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_WAIT_S = 86_400.0  # a timeout longer than a day is a typo (inf crashed uvicorn's graceful shutdown)


@dataclass(frozen=True)
class ServerSettings:
    model_name: str = "hypic"  # the id clients pass as ``model``
    # other names a request's ``model`` may give (the --model path as typed and resolved, as vLLM serves
    # the --model string: clients that load the tokenizer from that path send it as the model)
    model_aliases: tuple[str, ...] = ()
    api_key: str | None = None  # None: no authentication
    max_segments: int = 256  # per request (and per /v1/segments call)
    max_prompt_tokens: int | None = None  # None: the model's position limit
    max_completion_tokens: int = 2048  # cap on max_tokens; also the chat default
    max_concurrent: int = 16  # requests decoding together
    max_queue: int = 256  # requests waiting for a decode slot (every request waits there first); beyond: 429
    max_choices: int = 8  # cap on a request's ``n`` (each choice runs as a request of its own)
    max_prompts: int = 32  # cap on a completions batch (a list of prompts), each with its n choices
    max_prefill_tokens: int | None = None  # tokens computed per prefill call (Scheduler); None: no limit
    request_timeout_s: float = 600.0  # arrival to last token; beyond: cancelled, 504
    shutdown_timeout_s: float = 30.0  # in-flight requests may finish for this long, then are cancelled
    # at shutdown, requests queued (admitted, not yet running) are served within the timeout too; by default
    # they are refused at once with a 503 and Retry-After, so a load balancer sends them to another replica
    shutdown_drain: bool = False
    # vLLM's --scheduling-policy: "fcfs" (first come, first served; a request's priority must be 0)
    # or "priority" (the queue ordered by each request's priority, lower first, then by arrival)
    scheduling_policy: str = "fcfs"
    max_body_bytes: int = 32 << 20
    retry_after_s: int = 1  # the Retry-After a 429/503 advertises
    cache_dir: str | None = None  # where POST /v1/segments/save writes the cache (``hypic serve --cache-dir``)
    reasoning_parser: str | None = None  # "think": chat answers' <think>…</think> → reasoning_content
    max_stored_responses: int = 1024  # Responses API: the latest kept for previous_response_id; 0: none

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError("model_name: expected a non-empty string")
        if not isinstance(self.model_aliases, tuple) or not all(isinstance(a, str) and a for a in self.model_aliases):
            raise ValueError("model_aliases: expected a tuple of non-empty strings")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("api_key: expected a non-empty string or None")
        if self.api_key is not None:  # as clients' tokens are read: a key from a file keeps its newline
            object.__setattr__(self, "api_key", self.api_key.strip())
        for name in ("max_segments", "max_completion_tokens", "max_concurrent", "max_body_bytes", "retry_after_s",
                     "max_choices", "max_prompts", "max_queue"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected an integer ≥ 1, got {value!r}")
        for name in ("max_prompt_tokens", "max_prefill_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}: expected an integer ≥ 1 or None, got {value!r}")
        if not isinstance(self.max_stored_responses, int) or isinstance(self.max_stored_responses, bool) \
                or self.max_stored_responses < 0:
            raise ValueError(f"max_stored_responses: expected an integer ≥ 0, got {self.max_stored_responses!r}")
        if not isinstance(self.shutdown_drain, bool):
            raise ValueError(f"shutdown_drain: expected a boolean, got {self.shutdown_drain!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy: expected 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.reasoning_parser not in (None, "think"):
            raise ValueError(f"reasoning_parser: expected 'think' or None, got {self.reasoning_parser!r}")
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir):
            raise ValueError("cache_dir: expected a non-empty folder path or None")
        for name in ("request_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= MAX_WAIT_S:
                raise ValueError(f"{name}: expected a positive number of seconds up to {MAX_WAIT_S:g}, got {value!r}")
