"""Reasoning apart from the answer (``--reasoning-parser think``): ``<think>…</think>`` becomes
``reasoning_content``, whether the model opens the block or the prompt does; streamed at any split
the same as whole; a template told not to think gives the answer alone."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from hypic.server.reasoning import ThinkSplit, opened_by, split
from tests.server.conftest import MODEL, LiveServer, build_model, openai_client, serve_with_template

THINK_TEMPLATE = (  # Qwen3.5-like: the generation prompt opens the reasoning unless told not to think
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")


@pytest.mark.parametrize("text, opened, reasoning, content", [
    ("<think>\nweigh it\n</think>\n\nThe mill.", False, "\nweigh it\n", "The mill."),
    ("\n<think>a</think>b", False, "a", "b"),
    ("weigh it</think>\n\nThe mill.", True, "weigh it", "The mill."),
    ("The mill.", False, "", "The mill."),
    ("The mill. <think>not reasoning</think>", False, "", "The mill. <think>not reasoning</think>"),
    ("<think>cut short", False, "cut short", ""),
    ("still thinking </thi", True, "still thinking </thi", ""),
    ("<thi", False, "", "<thi"),
    ("a</think>", True, "a", ""),
])
def test_reasoning_and_answer_at_every_split(text: str, opened: bool, reasoning: str, content: str) -> None:
    assert split(text, opened) == (reasoning, content)
    for seed in range(25):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
        s = ThinkSplit(opened)
        got_r = got_c = ""
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            r, c = s.push(text[a:b])
            got_r, got_c = got_r + r, got_c + c
            assert reasoning.startswith(got_r) and content.startswith(got_c)  # never out of order, never taken back
        r, c = s.finish()
        assert (got_r + r, got_c + c) == (reasoning, content)


def test_the_prompt_says_whether_it_opened_the_reasoning() -> None:
    assert opened_by("<|im_start|>assistant\n<think>\n") and not opened_by("<|im_start|>assistant\n")
    assert not opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def think_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = serve_with_template(model_dir, tmp_path_factory.mktemp("think_model"), THINK_TEMPLATE,
                               max_completion_tokens=32, reasoning_parser="think")
    yield live
    live.stop()


def test_a_thinking_template_answers_with_reasoning_content_whole_and_streamed(think_server: LiveServer) -> None:
    client: OpenAI = openai_client(think_server)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Who founded the mill?"}], max_tokens=12,
               temperature=0)
    whole = client.chat.completions.create(**ask).choices[0]
    reasoning = whole.message.model_extra.get("reasoning_content")
    # random weights never close the block: the whole answer is reasoning, cut by max_tokens
    assert reasoning and whole.message.content == "" and whole.finish_reason == "length"
    chunks = [c for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    assert streamed == reasoning and not "".join(c.choices[0].delta.content or "" for c in chunks)
    plain = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})
    assert plain.choices[0].message.content


COUNT = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


def test_a_constraint_holds_the_answer_after_the_reasoning(tmp_path: Path) -> None:
    """With a reasoning parser, structured output waits for the reasoning's end (vLLM's way): a model
    whose vocabulary has ``<think>`` / ``</think>`` as tokens of text, pushed by ``logit_bias`` to
    write one word of reasoning and close it, reasons and then answers JSON the schema accepts —
    whether the prompt opened the reasoning or the model did (held from the first byte, as before,
    it could not reason at all). The same for a regex, a choice and a grammar."""
    folder = build_model(tmp_path / "model", added=("<think>", "</think>"))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    word, opener, closer = (tok.token_to_id(t) for t in ("a", "<think>", "</think>"))
    weights = load_file(str(folder / "model.safetensors"))
    weights["lm_head.weight"][[word, opener, closer]] = 0  # their logits 0: the biases alone order them
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    live = serve_with_template(folder, tmp_path / "served", THINK_TEMPLATE, max_completion_tokens=64,
                               reasoning_parser="think")
    try:
        client = openai_client(live)
        # "a" first (100), then — its presence penalised — "</think>" (99); "<think>" (98) opens where it may
        bias = {str(word): 100, str(closer): 99, str(opener): 98}
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "How many?"}], max_tokens=64, temperature=0,
                   logit_bias=bias, presence_penalty=2.0)
        for kwargs in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):  # opened by the prompt, or not
            out = client.chat.completions.create(**ask, response_format={"type": "json_schema", "json_schema": {
                "name": "count", "schema": COUNT}}, extra_body=kwargs).choices[0]
            assert out.message.model_extra.get("reasoning_content") == "a", (kwargs, out.message)
            assert set(json.loads(out.message.content)) == {"n"} and out.finish_reason == "stop"
        for held, ok in (({"regex": "[0-9]{2}"}, lambda t: re.fullmatch("[0-9]{2}", t)),
                         ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                         ({"grammar": 'root ::= "x" [0-9]'}, lambda t: re.fullmatch("x[0-9]", t))):
            out = client.chat.completions.create(**ask, extra_body={"structured_outputs": held}).choices[0]
            assert out.message.model_extra.get("reasoning_content") == "a" and ok(out.message.content), (held, out)
    finally:
        live.stop()


def test_an_answer_sent_back_as_it_came_continues_the_conversation(think_server: LiveServer) -> None:
    """The assistant message with its reasoning_content (vLLM's reasoning too), as clients append
    it: it was a 400 (an unrecognized field)."""
    client: OpenAI = openai_client(think_server)
    ask = [{"role": "user", "content": "Who founded the mill?"}]
    first = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=6, temperature=0).choices[0]
    for field in ("reasoning_content", "reasoning"):
        turn = {"role": "assistant", "content": first.message.content or "The Orrick family.",
                field: first.message.model_extra.get("reasoning_content") or "thinking"}
        nxt = client.chat.completions.create(model=MODEL, messages=[*ask, turn, {"role": "user", "content": "When?"}],
                                             max_tokens=4, temperature=0)
        assert nxt.choices[0].finish_reason in ("length", "stop")


def test_a_responses_answers_reasoning_is_counted_in_its_usage(think_server: LiveServer) -> None:
    client: OpenAI = openai_client(think_server)
    ask = dict(model=MODEL, input="Who founded the mill?", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**ask)
    assert [o.type for o in whole.output] == ["reasoning"] and whole.usage.output_tokens == 12
    assert whole.usage.output_tokens_details.reasoning_tokens > 6  # re-counted from the text: about all 12
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events if e.type != "response.reasoning_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done", f"response.{whole.status}"]
    assert events[-3].part.type == "reasoning_text" and events[-3].part.text == whole.output[0].content[0].text
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == \
        whole.usage.output_tokens_details.reasoning_tokens


@pytest.mark.parametrize("pieces, first", [  # first: the message's first token
    (["weigh", " it", "</think>", "\n\n", "The", " mill", "."], 2),
    (["weigh it</think>", "\n\nThe", " mill."], 1),
    (["weigh", " it</", "think>\n", "\nThe mill", "."], 2),  # " it" goes out as reasoning, "</" is held
])
def test_a_responses_message_logprobs_are_the_tokens_after_the_reasoning(pieces: list[str], first: int) -> None:
    """``include: message.output_text.logprobs`` with a reasoning parser: the message's log-probabilities
    are of the tokens after the last one that carried reasoning text, whatever the tokenization."""
    from tokenizers import Tokenizer

    from hypic import SamplingParams
    from hypic.server.generation import Generation, Piece, Responder
    from hypic.server.logprobs import Scored
    from hypic.server.responses import MessageTokens

    tok = Tokenizer.from_file(str(Path(__file__).parents[2] / "hypic" / "assets" / "tokenizer" / "tokenizer.json"))
    tok.add_tokens(list(pieces))  # each piece one token
    ids = [tok.token_to_id(p) for p in pieces]
    assert None not in ids and tok.decode(ids) == "".join(pieces)
    gen = Generation(chat=True, model=MODEL, prompt=[[1]], params=SamplingParams(), mode="hypic", salt=None,
                     stream=False, include_usage=False, stops=[], top_logprobs=0, think=True)
    r = Responder(gen, None, tok, None)  # no job: the pieces are fed by hand
    track = MessageTokens(r)
    sent, message = [], ""
    for k, t in enumerate(ids):
        scored = Scored(t, {t: -0.5 - k}, len(r.text.text))
        piece = Piece(r.text.push(t), [scored], "length" if k == len(ids) - 1 else None)
        delta, _, taken = track.delta(piece)
        message += delta.get("content", "")
        sent += taken
    assert message == "The mill."
    assert [e["token"] for e in track.message] == pieces[first:] and sent == track.message
    assert [e["logprob"] for e in track.message] == [-0.5 - k for k in range(first, len(pieces))]
