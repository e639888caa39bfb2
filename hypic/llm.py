"""The offline API: ``LLM(model).generate(prompts, sampling, mode=...)``.

A prompt is a list of segments — each a string (tokenized on its own, without special tokens) or
a list of token ids — whose last element is the query, or one string split on ``<<PIC_SEP>>``.
``generate`` takes one prompt or a list of prompts; ``stream`` yields one prompt's answer as it comes.
"""

from __future__ import annotations

import collections
import itertools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hypic.cache.budgets import AUTO, Budget
from hypic.engine.beam_search import BeamSearchOutput, BeamSearchParams, search
from hypic.engine.engine import Engine
from hypic.engine.request import RequestOutput, SamplingParams, check_seed, check_utf8
from hypic.engine.warm_up import WarmUp, warm_up
from hypic.models.loader import load_model
from hypic.models.tokenize import encode

SEPARATOR = "<<PIC_SEP>>"
# a string (split on SEPARATOR), a list of segments (strings or token-id lists), one segment's token ids,
# or vLLM's prompt dicts: {"prompt": text} and {"prompt_token_ids": ids}
Prompt = str | list[str | list[int]] | list[int] | dict[str, Any]


@dataclass(frozen=True)
class Delta:
    """A step of a streamed answer: the text it adds, its new token ids, and the request's output so
    far (``finish_reason``, metrics; ``text`` whole once ``done``)."""

    text: str
    token_ids: list[int]
    output: RequestOutput
    done: bool = False  # the last delta: the answer has ended


def bundled_model_path() -> Path:
    return Path(__file__).parent / "assets" / "default_model"


class LLM:
    def __init__(self, model: str | None = None, *, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, seam: int = 8, cold: str = "standalone",
                 cache_device_bytes: Budget = AUTO, cache_host_bytes: Budget = AUTO,
                 cold_workers: int | list[str] | None = None, route: str = "lpt",
                 cache_host_dtype: str | None = AUTO, max_model_len: int | None = None,
                 seed: int | None = None, max_num_seqs: int = 256, quantization: str | None = "auto") -> None:
        """vLLM's ``dtype="auto"`` (the default: the checkpoint's on a GPU, fp32 on the CPU),
        ``max_model_len`` (a context shorter than the model's), ``seed`` (torch's global generator,
        which requests without a seed draw from: their answers repeat from run to run) and
        ``max_num_seqs`` (the most answers ``generate`` decodes at once: the rest wait their turn)
        mean what they mean there; ``model`` is a local folder (nothing is downloaded).
        ``quantization="fp8"`` holds the projections and experts in 8 bits with row scales, as vLLM's
        ``quantization="fp8"`` does: half the weight memory (hypic.models.layers.fp8); "auto" (the
        default) does so for an FP8 checkpoint on a GPU; None keeps every weight in ``dtype``."""
        if model is None:
            model = str(bundled_model_path())
            if not Path(model).is_dir():
                raise ValueError("model: no bundled default model in this installation; pass a model folder")
        _folder(model, "model")
        if isinstance(model, str) and not Path(model).exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", model):
            raise ValueError(f"model: {model} is not a folder here; hypic loads local folders and downloads "
                             f"nothing (fetch it first, e.g. `huggingface-cli download {model} --local-dir DIR`)")
        check_seed(seed, "seed", optional=True)
        if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected an integer ≥ 1, got {max_num_seqs!r}")
        self.max_num_seqs = max_num_seqs
        if seed is not None:
            torch.manual_seed(seed)
        self.loaded = load_model(model, device=device, dtype=None if dtype == "auto" else dtype,
                                 quantization=quantization)
        self.engine = Engine(self.loaded, seam=seam, cold=cold, cache_device_bytes=cache_device_bytes,
                             cache_host_bytes=cache_host_bytes, cold_workers=cold_workers, route=route,
                             cache_host_dtype=cache_host_dtype)
        self.tokenizer = self.loaded.tokenizer
        self._chat_template = None  # the model's chat template, read at the first chat() (hypic.server.chat)
        self._hf_tokenizer = None  # get_tokenizer's, made at its first call
        self.max_positions = self.loaded.model.max_positions
        if max_model_len is not None:
            if (not isinstance(max_model_len, int) or isinstance(max_model_len, bool)
                    or not 2 <= max_model_len <= self.max_positions):
                raise ValueError(f"max_model_len: expected an integer in [2, {self.max_positions}] (the model's "
                                 f"context), got {max_model_len!r}")
            self.max_positions = self.engine.max_positions = max_model_len
        self.vocab_size = self.loaded.model.vocab_size
        self._requests = itertools.count()  # request ids, as vLLM numbers them

    def _segment_ids(self, segment: Any, where: str) -> list[int]:
        if isinstance(segment, str):
            if not segment:
                raise ValueError(f"{where}: empty segment")
            check_utf8(segment, where)
            if self.tokenizer is None:
                raise ValueError(f"{where}: this model has no tokenizer.json; pass token ids")
            ids = encode(self.tokenizer, segment).ids
            if not ids:
                raise ValueError(f"{where}: segment has no tokens")
            return ids
        if isinstance(segment, (list, tuple)):
            if not segment:
                raise ValueError(f"{where}: empty segment")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in segment):
                raise ValueError(f"{where}: token ids must be integers")
            bad = [t for t in segment if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            return list(segment)
        raise ValueError(f"{where}: a segment must be a string or a list of token ids, got {type(segment).__name__}")

    def _prompt_ids(self, prompt: Prompt, params: SamplingParams, where: str = "prompt") -> list[list[int]]:
        """``prompt``'s token ids per segment as ``params`` has them read: its last tokens only with
        ``truncate_prompt_tokens`` (a prompt to be cut may then be longer than the context)."""
        keep = params.truncate_prompt_tokens
        return cut_prompt(self.tokenize(prompt, where, limit=keep is None), keep, self.max_positions)

    def tokenize(self, prompt: Prompt, where: str = "prompt", limit: bool = True) -> list[list[int]]:
        """A prompt → token ids per segment (validated); ``limit``: refused past the model's context
        (False: a prompt to be cut to its last tokens, as ``truncate_prompt_tokens`` asks)."""
        prompt = _undict(prompt, where)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{where}: empty prompt")
            parts: list[Any] = prompt.split(SEPARATOR)
        elif _is_ids(prompt):  # one segment's token ids (vLLM's token prompt)
            parts = [prompt]
        elif isinstance(prompt, (list, tuple)):
            parts = list(prompt)
        else:
            raise ValueError(f"{where}: expected a string or a list of segments, got {type(prompt).__name__}")
        if not parts:
            raise ValueError(f"{where}: empty prompt")
        segments = [self._segment_ids(s, f"{where}.segments[{i}]") for i, s in enumerate(parts)]
        total = sum(len(s) for s in segments)
        if limit and total >= self.max_positions:
            raise ValueError(f"{where}: {total} tokens exceed the model's limit of {self.max_positions - 1}")
        return segments

    def check_context(self, prompt_tokens: int, max_tokens: int | None, prompt: str = "the prompt") -> None:
        """Refuse a prompt whose tokens plus ``max_tokens`` exceed the model's context: decoding would
        run on at positions the model was never trained on (RoPE is computed on the fly, so nothing
        else stops it). The server's ``prompts.token_budget`` asks the same, so both refuse alike."""
        if max_tokens is None:  # up to the context: at least one token must fit
            max_tokens = 1
        if prompt_tokens + max_tokens > self.max_positions:
            raise ValueError(f"max_tokens: {prompt}'s {prompt_tokens} tokens plus {max_tokens} to generate exceed "
                             f"the model's context of {self.max_positions} tokens")

    def _normalize(self, prompts: Prompt | list[Prompt]) -> list[Prompt]:
        if isinstance(prompts, (str, dict)) or _is_ids(prompts):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if not prompts:
                raise ValueError("prompts: empty list")
            return list(prompts)
        raise ValueError(f"prompts: expected a prompt or a list of prompts, got {type(prompts).__name__}")

    def generate(self, prompts: Prompt | list[Prompt], sampling: SamplingParams | list[SamplingParams] | None = None,
                 *, mode: str = "hypic", cache_salt: str | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """Answer each prompt (``sampling_params``: vLLM's name for ``sampling``; ``use_tqdm`` is
        taken for vLLM's callers and shows nothing). The runs decode together; one whose text reaches a
        stop string ends there, the others go on. A prompt with ``n`` answers runs n requests (answer
        i seeded seed + i), returned as one output whose ``outputs`` lists them. ``priority`` (vLLM's):
        one integer per prompt; when more answers than ``max_num_seqs`` wait, a lower value starts
        first, ties in order (the outputs keep the prompts' order)."""
        items = self._normalize(prompts)
        sampling = _sampling(sampling, sampling_params) or SamplingParams()
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(items)
        if len(params) != len(items) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("sampling: expected a SamplingParams or one per prompt")
        ids = [self._prompt_ids(item, p, f"prompts[{i}]")
               for i, (item, p) in enumerate(zip(items, params, strict=True))]
        for i, (segments, p) in enumerate(zip(ids, params, strict=True)):
            self.check_context(sum(len(s) for s in segments), p.max_tokens,
                               "the prompt" if len(ids) == 1 else f"prompts[{i}]")
            self._check_text_options(p)
        if priority is not None and (not isinstance(priority, (list, tuple)) or len(priority) != len(items) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in priority)):
            raise ValueError(f"priority: expected one integer per prompt ({len(items)}), got {priority!r}"[:300])
        answers = [(i, j) for i, p in enumerate(params) for j in range(p.n)]
        ranks = None if priority is None else [priority[i] for i, _ in answers]
        outputs = self._run([ids[i] for i, _ in answers], [params[i].for_choice(j) for i, j in answers],
                            mode, self._salt(cache_salt), ranks)
        result, at = [], 0
        for item, segments, p in zip(items, ids, params, strict=True):
            group, at = outputs[at:at + p.n], at + p.n
            rid = str(next(self._requests))
            for j, out in enumerate(group):
                out.index, out.request_id, out.prompt = j, rid, _prompt_text(item)
                out.prompt_token_ids = [t for s in segments for t in s]
                out.prompt_logprobs = group[0].prompt_logprobs  # scored by the first answer only
            group[0].others = group[1:]
            result.append(group[0])
        return result

    def _run(self, ids: list[list[list[int]]], params: list[SamplingParams], mode: str,
             salt: str | None, priority: list[int] | None = None) -> list[RequestOutput]:
        """One answer per prompt (texts and stop strings with a tokenizer). At most ``max_num_seqs``
        decode at once; as answers end, the next prompts are prefilled between decode steps and join
        them — so a batch of any size (10 000 prompts, or one prompt with a large ``n``) runs in the
        memory of ``max_num_seqs`` answers, where starting every prompt at once held every decode
        state together. Later prompts find the documents earlier ones cached."""
        self.engine.checked(ids, params)  # a bad prompt anywhere is refused before any runs, as before
        texts = [None if self.tokenizer is None else self._text_stream(p) for p in params]
        runs: list[Any] = [None] * len(ids)
        read = [0] * len(ids)
        order = range(len(ids)) if priority is None else sorted(range(len(ids)), key=priority.__getitem__)
        pending = collections.deque(order)  # a stable sort: ties keep the prompts' order
        live: list[int] = []
        try:
            while True:
                for i in live:  # what each answer added; a stop string ends its run, the others go on
                    text = texts[i]
                    if text is None:
                        continue
                    for t in runs[i].output.token_ids[read[i]:]:
                        text.push(t)
                    read[i] = len(runs[i].output.token_ids)
                    if text.stopped and not runs[i].done:
                        self.engine.forget([runs[i]])  # (_ended says why)
                live = [i for i in live if not runs[i].done]
                room = self.max_num_seqs - len(live)
                if pending and room > 0:
                    wave = [pending.popleft() for _ in range(min(room, len(pending)))]
                    started = self.engine.start([ids[i] for i in wave], [params[i] for i in wave], mode=mode,
                                                salts=[salt] * len(wave))
                    for i, run in zip(wave, started, strict=True):
                        runs[i] = run
                    live += wave
                    continue  # their first tokens are read before the next step (one may end at once)
                if not live:
                    break
                self.engine.step([runs[i] for i in live])
        finally:
            unfinished = [runs[i] for i in live if not runs[i].done]
            if unfinished:  # a failure or an interrupt: no decode state left behind
                self.engine.forget(unfinished)
        for run, text in zip(runs, texts, strict=True):
            if text is not None:
                text.finish()
            self._ended(run, text)
        return [r.output for r in runs]

    def _check_text_options(self, p: SamplingParams) -> None:
        if self.tokenizer is None and (p.stop or p.include_stop_str_in_output or not p.skip_special_tokens):
            raise ValueError("stop: this model has no tokenizer.json, so there is no text to search or to show "
                             "special tokens in")

    def _text_stream(self, p: SamplingParams) -> Any:
        """The answer's text as it is generated (``hypic.server.text``; no server dependency)."""
        from hypic.server.text import answer_text

        return answer_text(self.tokenizer, p, self.engine.eos)

    @staticmethod
    def _ended(run: Any, text: Any | None) -> None:
        """The output's text (none without a tokenizer), and what stopped it: the stop string, a stop
        token's id, or None."""
        from hypic.server.text import stop_reason

        if run.error is not None:  # the library's caller is told as the engine's was (the batch's call)
            raise run.error
        out = run.output
        if text is not None:
            out.text = text.text
        if text is not None and text.stop_string is not None:
            out.finish_reason = "stop"
        out.stop_reason = stop_reason(text, out.token_ids, out.finish_reason, run.params.stop_token_ids)

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None, *, mode: str = "hypic",
               cache_salt: str | None = None, sampling_params: SamplingParams | None = None) -> Iterator[Delta]:
        """One prompt's answer as it is generated: a ``Delta`` per decode step that adds tokens (and a
        last one when it ends), whose texts joined equal ``generate``'s text and whose token ids joined
        equal the output's. A step's text may be empty — a special token, or the first bytes of a
        character split across tokens (its text comes with the token that completes it) — but its ids
        are never held back. Each delta's ``output`` is the request's one output, live (read after
        the loop, every delta shows the ended answer; copy what a step must keep). ``prompt`` is one
        prompt: a list of strings is its segments here, where ``generate`` reads a batch. Leaving the
        loop early (``break``) lets go of the request's decode state."""
        if self.tokenizer is None:
            raise ValueError("stream: this model has no tokenizer.json; generate() returns token ids")
        params = _sampling(sampling, sampling_params) or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling: expected a SamplingParams")
        ids = self._prompt_ids(prompt, params)
        if params.n != 1:
            raise ValueError(f"n: stream yields one answer, got n={params.n}; generate returns n")
        self.check_context(sum(len(s) for s in ids), params.max_tokens)
        runs = self.engine.start([ids], [params], mode=mode, salts=[self._salt(cache_salt)])
        run, text, sent = runs[0], self._text_stream(params), 0
        run.output.prompt_token_ids = [t for s in ids for t in s]
        run.output.prompt, run.output.request_id = _prompt_text(prompt), str(next(self._requests))
        try:
            while True:
                new = run.output.token_ids[sent:]
                sent += len(new)
                piece = "".join(text.push(t) for t in new)
                if text.stopped and not run.done:  # a stop string (_ended says why)
                    self.engine.forget(runs)
                if run.done:
                    piece += text.finish()
                    self._ended(run, text)  # the text whole, now that it is complete
                    yield Delta(piece, new, run.output, done=True)
                    return
                if new:
                    yield Delta(piece, new, run.output)
                self.engine.step(runs)
        finally:
            if not run.done:
                self.engine.forget(runs)

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams, *, mode: str = "hypic",
                    cache_salt: str | None = None,
                    use_tqdm: bool | Callable[..., Any] = False) -> list[BeamSearchOutput]:
        """vLLM's beam search (``hypic.engine.beam_search``): per prompt, the ``params.beam_width``
        best beams, best first, each with its tokens (the prompt's, then its own), their summed
        log-probability and its text. Each step is one token of every live beam of every prompt,
        decoded together; under ``hypic`` the documents are cached once and each step recomputes a
        beam's seams and query with the tokens it chose."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params: expected a BeamSearchParams, got {type(params).__name__}")
        items = self._normalize(prompts)
        ids = [self._prompt_ids(item, SamplingParams(), f"prompts[{i}]") for i, item in enumerate(items)]
        for i, segments in enumerate(ids):
            self.check_context(sum(len(s) for s in segments), params.max_tokens,
                               "the prompt" if len(ids) == 1 else f"prompts[{i}]")
        salt = self._salt(cache_salt)

        def step(batch: list[list[list[int]]], ask: SamplingParams) -> list[dict[int, float]]:
            return [out.logprobs[0] for out in self._run(batch, [ask] * len(batch), mode, salt)]

        results = search(step, ids, params, set(self.engine.eos))
        for segments, result in zip(ids, results, strict=True):
            start = sum(len(s) for s in segments)
            for beam in result.sequences:
                beam.text = None if self.tokenizer is None else self.tokenizer.decode(
                    beam.tokens[start:], skip_special_tokens=not params.include_stop_str_in_output)
        return results

    def chat(self, conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling: SamplingParams | list[SamplingParams] | None = None, *, mode: str = "hypic",
             cache_salt: str | None = None, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, use_tqdm: bool | Callable[..., Any] = True) -> list[RequestOutput]:
        """One conversation (OpenAI's messages) or a list of them, rendered with the model's chat
        template (ChatML without one; ``chat_template``: this Jinja text instead) and answered. As in
        the server's chat route, each message — each text part of a message — is a segment of its own:
        documents sent as messages hit the cache wherever they sit. ``tools`` and
        ``chat_template_kwargs`` go to the template; ``add_generation_prompt`` and
        ``continue_final_message`` mean what they mean in vLLM (the answer begins a new assistant turn,
        or continues the last message); the answer is text (the server turns it into tool calls or
        reasoning); each output's ``prompt`` is the rendered conversation."""
        from hypic.server.chat import ChatTemplate, check_template_kwargs  # the server package imports this module

        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise ValueError("conversations: expected a list of messages or a list of conversations")
        batch = [conversations] if isinstance(conversations[0], dict) else list(conversations)
        if chat_template is not None:
            if not isinstance(chat_template, str) or not chat_template:
                raise ValueError("chat_template: expected the template's Jinja text")
            model = self._template()  # its bos and eos tokens
            try:
                template = ChatTemplate(chat_template, bos_token=model.bos_token, eos_token=model.eos_token)
            except Exception as e:  # noqa: BLE001 — jinja's syntax errors, named
                raise ValueError(f"chat_template: {type(e).__name__}: {e}") from None
        else:
            template = self._template()
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs: expected a dict, got {type(chat_template_kwargs).__name__}")
        check_template_kwargs(chat_template_kwargs)  # messages, tools, add_generation_prompt: arguments here
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools: expected a list of tool objects (dicts)")
        for name, value in (("add_generation_prompt", add_generation_prompt),
                            ("continue_final_message", continue_final_message)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}: expected a boolean, got {value!r}")
        context = {**(chat_template_kwargs or {}), "tools": tools}
        prompts = []
        for k, messages in enumerate(batch):
            turns, extras = _messages(messages, f"conversations[{k}]")
            prompts.append([seg.text for seg in template.segments(
                turns, context, extras, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message)])
        outs = self.generate(prompts, _sampling(sampling, sampling_params), mode=mode, cache_salt=cache_salt)
        for out, segments in zip(outs, prompts, strict=True):
            for choice in out.outputs:
                choice.prompt = "".join(segments)  # the conversation as the template rendered it (vLLM's)
        return outs

    def get_tokenizer(self) -> Any:
        """The model's tokenizer as transformers' (vLLM's ``get_tokenizer``): ``encode`` → ids,
        ``decode``, ``apply_chat_template`` with the template ``chat`` uses, ``eos_token_id``. Needs
        transformers; ``llm.tokenizer`` is the ``tokenizers`` one, ``llm.tokenize(prompt)`` ids per segment."""
        if self.tokenizer is None:
            raise ValueError("get_tokenizer: this model has no tokenizer.json")
        if self._hf_tokenizer is None:
            try:
                from transformers import PreTrainedTokenizerFast
            except ImportError:
                raise ValueError("get_tokenizer: needs transformers (pip install transformers); llm.tokenizer is "
                                 "the model's tokenizers.Tokenizer") from None
            template = self._template()
            self._hf_tokenizer = PreTrainedTokenizerFast(
                tokenizer_object=self.tokenizer, chat_template=template.source,
                bos_token=template.bos_token or None, eos_token=template.eos_token or None,
                model_max_length=self.max_positions)
        return self._hf_tokenizer

    def _template(self) -> Any:
        """The model's chat template (hypic.server.chat), read once."""
        from hypic.server.chat import ChatTemplate

        if self._chat_template is None:
            self._chat_template = ChatTemplate.from_model(self.loaded.tokenizer_config, self.loaded.path)
        return self._chat_template

    def prewarm(self, documents: list[str | list[int]], *, cache_salt: str | None = None) -> list[bool | None]:
        """Prefill documents (text or token ids) into the cache before the prompts that use them: per
        document, True if it was cached already, False if filled now, None if too short to cache."""
        ids = self._documents(documents)
        for i, doc in enumerate(ids):  # no prompt could hold it: its prefill would be wasted (and unbounded)
            if len(doc) >= self.max_positions:
                raise ValueError(f"documents[{i}]: {len(doc)} tokens exceed the model's limit of "
                                 f"{self.max_positions - 1}")
        return self.engine.prewarm(ids, salt=self._salt(cache_salt))

    def warm_up(self) -> WarmUp:
        """Run every path a request can take once, on synthetic prompts, so that the first requests
        do not pay for compiling and tuning kernels (seconds to a minute on a GPU); the counters of
        work are left as they were, faults met are kept and reported (``hypic.engine.warm_up``). Best
        before the cache fills, and never while requests run: ``hypic serve`` does it on a GPU before
        loading a saved cache. Into a store at its budget, the entries its documents (evicted after)
        pushed down a tier, or out where there is no lower tier, stay there."""
        return warm_up(self.engine)

    def evict(self, documents: list[str | list[int]], *, cache_salt: str | None = None,
              saved: str | Path | None = None) -> list[bool]:
        """Forget documents (changed or withdrawn): their entries, the prefix states holding them and,
        with ``saved``, their entries in that saved cache folder; per document, whether anything of it
        was cached (``Engine.evict_segments``)."""
        if saved is not None and not isinstance(saved, (str, Path)):
            raise ValueError(f"saved: expected a folder path, got {type(saved).__name__}")
        return self.engine.evict_segments(self._documents(documents), salt=self._salt(cache_salt), saved=saved)

    def _documents(self, documents: list[str | list[int]]) -> list[list[int]]:
        if not isinstance(documents, (list, tuple)) or not documents:
            raise ValueError("documents: expected a non-empty list of texts or token-id lists")
        return [self._segment_ids(d, f"documents[{i}]") for i, d in enumerate(documents)]

    @staticmethod
    def _salt(cache_salt: str | None) -> str | None:
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt: expected a string")
        if cache_salt == "":  # it would key entries as no salt does: another tenant's entries served
            raise ValueError("cache_salt: empty (leave it out for no salt)")
        return cache_salt if cache_salt is None else check_utf8(cache_salt, "cache_salt")

    def close(self) -> None:
        """Stop the cold workers, if any."""
        self.engine.close()

    def save_cache(self, folder: str | Path) -> int:
        """Save the segment cache into ``folder`` (one file per entry and a manifest); how many entries."""
        folder = _folder(folder, "folder")
        for path in (Path(folder), *Path(folder).parents):  # a file in the way: mkdir's OSError, unnamed
            if path.exists():
                if not path.is_dir():
                    raise ValueError(f"folder: {path} is a file, not a folder")
                break
        return self.engine.save_cache(folder)

    def load_cache(self, folder: str | Path) -> int:
        """Load a cache saved by ``save_cache`` for this model; how many entries the cache took."""
        return self.engine.load_cache(_folder(folder, "folder"))

    def cache_stats(self) -> dict[str, Any]:
        s = self.engine.store.stats()
        states, held = self.engine.prefix.stats()  # the prefix mode's: what the store leaves of the device budget
        return {"entries": s.entries, "bytes": s.bytes, "budgets": s.budgets, "hits": s.hits, "misses": s.misses,
                "evictions": s.evictions, "promotions": s.promotions, "demotions": s.demotions,
                "host_pinned_bytes": s.host_pinned_bytes, "prefix_states": states, "prefix_bytes": held}


def _sampling(sampling: Any, sampling_params: Any) -> Any:
    """``sampling`` or vLLM's name for it, ``sampling_params`` — not both."""
    if sampling is not None and sampling_params is not None:
        raise ValueError("sampling_params: the same as sampling; pass one of them")
    return sampling if sampling is not None else sampling_params


def _is_ids(value: object) -> bool:
    """A non-empty list of token ids (integers): one segment, never a list of segments."""
    return (isinstance(value, (list, tuple)) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _undict(prompt: object, where: str) -> object:
    """vLLM's prompt dicts as hypic prompts: ``{"prompt": text}`` the text, ``{"prompt_token_ids": ids}``
    one segment of ids (as token ids, it is never split)."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt"}:
        return prompt["prompt"]
    if set(prompt) == {"prompt_token_ids"}:
        ids = prompt["prompt_token_ids"]
        if not _is_ids(ids):
            raise ValueError(f"{where}.prompt_token_ids: expected a non-empty list of token ids")
        return [list(ids)]
    raise ValueError(f"{where}: a prompt dict holds 'prompt' (text) or 'prompt_token_ids' alone, "
                     f"got keys {sorted(map(str, prompt))}")


def cut_prompt(segments: list[list[int]], keep: int | None, max_positions: int) -> list[list[int]]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: the longest prompt the
    context reads, a token's room left; None: all), as segments — those before the cut left out, the
    one it falls in keeping its tail (a new segment). ValueError for a count the model cannot read."""
    if keep is None:
        return segments
    longest = max_positions - 1  # a prompt leaves the context room for one token at least
    if not isinstance(keep, int) or isinstance(keep, bool) or keep == 0 or keep < -1 or keep > longest:
        raise ValueError(f"truncate_prompt_tokens: {keep!r} is not a number of tokens this model can read (1 to "
                         f"{longest}, its context less one, or -1 for that many)")
    left = longest if keep == -1 else keep
    out: list[list[int]] = []
    for segment in reversed(segments):
        if left <= 0:
            break
        out.append(segment[-left:] if len(segment) > left else segment)
        left -= len(segment)
    return out[::-1]


def _prompt_text(prompt: object) -> str | None:
    """A prompt as text (RequestOutput.prompt): as given, its segments joined by SEPARATOR (so it
    means the same prompt again); None when any part is token ids."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(s, str) for s in prompt):
        return SEPARATOR.join(prompt)
    return None


def _folder(path: object, name: str) -> str | Path:
    if not isinstance(path, (str, Path)):
        raise ValueError(f"{name}: expected a folder path, got {type(path).__name__}")
    if path == "":  # Path("") is the working directory: a save would write (and prune) there
        raise ValueError(f"{name}: empty path")
    return path


def _messages(messages: object, where: str) -> tuple[list[tuple[str, list[str]]], list[dict[str, Any]]]:
    """OpenAI's messages → (role, text parts) per message and what else the template reads; the
    server's rules for roles and content (``hypic.server.protocol``)."""
    from hypic.server.chat import ROLES, needs_content, no_content

    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of messages")
    turns, extras = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where}[{i}].role: every message needs a role")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}[{i}].role: expected one of {ROLES}, got {m['role']!r}")
        content = m.get("content")
        if content is None and needs_content(m["role"], m.get("tool_calls")):
            raise ValueError(f"{where}[{i}].content: {no_content(m['role'])}")
        if content is None or isinstance(content, str):
            parts = [content or ""]
        elif isinstance(content, list) and content and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            parts = [p["text"] for p in content]
        else:
            raise ValueError(f"{where}[{i}].content: expected a string, text parts or None")
        turns.append((m["role"], parts))
        extras.append({k: v for k, v in m.items() if k not in ("role", "content")})
    return turns, extras
