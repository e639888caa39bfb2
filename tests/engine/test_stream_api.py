"""``LLM.stream``: one prompt's answer as it is generated, on the bundled model — the pieces joined
are ``generate``'s text, token by token the same ids, the cache serving it warm; leaving early frees
the request; bad input refused by name."""

import pytest

from hypic import LLM, SamplingParams

DOCS = ["Profile of Mira. Mira lives in Quorvane and keeps bees on the roof.",
        "Profile of Tal. Tal plays the harp in Westvale every evening."]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def test_the_pieces_joined_are_generates_answer(llm: LLM) -> None:
    prompt = ["You are a careful reader.", *DOCS, "Question: Where does Mira live?\nAnswer:"]
    sp = SamplingParams(max_tokens=12, temperature=0)
    want = llm.generate([prompt], sp)[0]
    deltas = list(llm.stream(prompt[:1] + DOCS[::-1] + prompt[-1:], sp))  # the documents in another order
    assert [d.done for d in deltas] == [False] * (len(deltas) - 1) + [True]
    out = deltas[-1].output
    assert "".join(d.text for d in deltas) == out.text and out.finish_reason in ("stop", "length")
    assert [t for d in deltas for t in d.token_ids] == out.token_ids
    assert out.metrics.segment_hits == 2 and out.metrics.segment_misses == 0  # both documents, warm
    again = list(llm.stream(prompt, sp))
    assert "".join(d.text for d in again) == want.text and again[-1].output.token_ids == want.token_ids


@pytest.mark.parametrize("sp", [
    SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={1: 100}),  # EOS (<|end|>) again and again: no text
    # "é" is two byte-level tokens (129, 104): the first adds no text until the second completes it
    SamplingParams(max_tokens=6, logit_bias={129: 100, 104: 99}, frequency_penalty=2.0, presence_penalty=2.0)])
def test_steps_without_text_keep_their_token_ids(llm: LLM, sp: SamplingParams) -> None:
    deltas = list(llm.stream("Say café", sp))
    out = deltas[-1].output
    assert [t for d in deltas for t in d.token_ids] == out.token_ids and len(out.token_ids) == 6
    assert "".join(d.text for d in deltas) == out.text == llm.generate("Say café", sp)[0].text
    assert all(d.token_ids for d in deltas)  # a Delta per step that adds tokens, with or without text


def test_leaving_early_frees_the_request(llm: LLM, monkeypatch) -> None:
    prompt = [*DOCS, "Tell me about Quorvane."]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    forgotten, forget = [], llm.engine.forget
    monkeypatch.setattr(llm.engine, "forget", lambda runs: (forgotten.extend(runs), forget(runs)))
    stream = llm.stream(prompt, sp)
    first = next(stream)
    stream.close()  # what leaving a for loop does
    assert not first.done and len(first.output.token_ids) < 40
    assert len(forgotten) == 1 and forgotten[0].done and forgotten[0].output is first.output  # let go of
    assert len(llm.generate([prompt], sp)[0].token_ids) == 40  # the engine serves on


def test_bad_input_is_refused_by_name(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt"):
        next(llm.stream(""))
    with pytest.raises(ValueError, match="sampling"):
        next(llm.stream("hello", sampling={"max_tokens": 2}))
