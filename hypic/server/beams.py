"""vLLM's ``use_beam_search`` on the completions and chat routes: the request's ``n`` is the beam
width, and its ``n`` choices are the best beams, best first (``hypic.engine.beam_search``).

Each step's beams go through the scheduler as one-token requests, queued all at once like a
request's choices (so a beam search waits its turn, holds its priority and counts against the
queue as any request does); the answer is whole — a beam's text is known only when the search ends,
so ``stream`` is refused, as are what a beam cannot carry (log-probabilities, echo, structured output,
tools). ``temperature`` does not change which beams are kept (they are ranked by the model's own
log-probabilities, as vLLM ranks them) and is read past.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from hypic.engine.beam_search import MAX_WIDTH, BeamSearch, BeamSearchParams
from hypic.server.errors import APIError, bad_request
from hypic.server.generation import Generation
from hypic.server.runner import Runner, event_error


def check(gens: list[Generation]) -> None:
    """400 for what a beam search cannot answer, or would silently not apply: the beams are ranked by
    the model's own log-probabilities, so no stop string, banned or biased token, penalty or minimum
    length changes them (sampling's temperature, top-k, top-p and min-p do not either, as in vLLM: read
    past)."""
    gen = gens[0]
    p = gen.params
    for unapplied, param in ((bool(gen.stops) or bool(p.stop_token_ids), "stop"), (bool(p.logit_bias), "logit_bias"),
                             (bool(p.bad_words), "bad_words"), (p.presence_penalty != 0.0, "presence_penalty"),
                             (p.frequency_penalty != 0.0, "frequency_penalty"),
                             (p.repetition_penalty != 1.0, "repetition_penalty"), (p.min_tokens > 0, "min_tokens"),
                             (p.allowed_token_ids is not None, "allowed_token_ids")):
        if unapplied:
            raise bad_request(f"{param}: not with use_beam_search (beams are ranked by the model's own "
                              "log-probabilities)", param)
    if gen.n > MAX_WIDTH:
        raise bad_request(f"n: with use_beam_search n is the beam width, at most {MAX_WIDTH}; got {gen.n}", "n")
    for refused, param in ((gen.stream, "stream"), (gen.top_logprobs is not None, "logprobs"),
                           (gen.echo is not None, "echo"), (gen.tools is not None, "tools"),
                           (bool(gen.params.constraint_kinds), "response_format"),
                           (gen.params.prompt_logprobs is not None, "prompt_logprobs")):
        if refused:
            raise bad_request(f"{param}: not with use_beam_search (the beams are answered whole, as text)", param)


async def answer(runner: Runner, tokenizer: Any, gens: list[Generation], arrival: float, eos: set[int],
                 length_penalty: float, include_stop: bool) -> dict[str, Any]:
    """The response body: per prompt, its ``n`` best beams as choices (index = prompt × n + beam)."""
    check(gens)
    gen = gens[0]
    places, room = len(gens) * gen.n, runner.settings.max_queue + runner.settings.max_concurrent
    if places > room:  # a step's beams are queued at once: more than ever fit would be refused for ever
        raise bad_request(f"n: this search's {places} beams a step need {places} places, more than the server ever "
                          f"has ({room}: max_queue + max_concurrent)", "n")
    try:
        params = BeamSearchParams(beam_width=gen.n, max_tokens=min(g.params.max_tokens for g in gens),
                                  ignore_eos=gen.params.ignore_eos, length_penalty=length_penalty,
                                  include_stop_str_in_output=include_stop)
    except ValueError as e:
        raise bad_request(str(e), str(e).split(":")[0]) from None
    search = BeamSearch([g.prompt for g in gens], params, eos)
    while not search.done:
        pending = search.pending()
        jobs = runner.submit_all([(p, search.asked, gen.mode, gen.salt) for p in pending], arrival,
                                 priorities=[gen.priority] * len(pending))
        offered: list[dict[int, float]] = []
        try:
            for job in jobs:
                while True:
                    event = await job.next()
                    if event.kind == "error":
                        raise event_error(event, job.retry_after_s)
                    if event.kind == "done":
                        offered.append(event.output.logprobs[0])
                        break
        finally:
            for job in jobs:
                if not job.finished:
                    job.cancel()
        search.advance(offered)
    choices, completion = [], 0
    for i, (g, result) in enumerate(zip(gens, search.results(), strict=True)):
        start = len(g.prompt_ids)
        for k, beam in enumerate(result.sequences):
            own = beam.tokens[start:]
            completion += len(own)
            text = tokenizer.decode(own, skip_special_tokens=not include_stop) if tokenizer is not None else ""
            body = {"message": {"role": "assistant", "content": text}} if g.chat else {"text": text}
            choices.append({"index": i * gen.n + k, **body, "logprobs": None, "finish_reason": beam.finish_reason,
                            "stop_reason": None})
    prompt = sum(len(g.prompt_ids) for g in gens)
    if not choices:
        raise APIError(500, "the beam search ended without an answer", kind="engine", type="server_error")
    base = gen.request_id or uuid.uuid4().hex
    return {"id": f"{'chatcmpl' if gen.chat else 'cmpl'}-{base}",
            "object": "chat.completion" if gen.chat else "text_completion", "created": int(time.time()),
            "model": gen.model, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
