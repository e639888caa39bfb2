"""``LLM.stream``: one prompt's answer as it is generated, on the bundled model — the pieces joined
are ``generate``'s text, token by token the same ids, the cache serving it warm; leaving early frees
the request; bad input refused by name."""

import pytest

from hypic import LLM, SamplingParams

DOCS = ["Profile of Mira. Mira lives in Quorvane and keeps bees on the roof.",
        "Profile of Tal. Tal plays the harp in Westvale every evening."]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")  # a CPU test wherever it runs (on a GPU LLM() is bf16)


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
    # the output as each delta comes: unfinished (None, as vLLM says it) until the last
    reasons = [d.output.finish_reason for d in llm.stream(prompt, SamplingParams(max_tokens=4, ignore_eos=True))]
    assert reasons == [None] * (len(reasons) - 1) + ["length"] and len(reasons) >= 2


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


def _long_answer(llm: LLM) -> tuple[list[str], str, list[int]]:
    prompt = ["You are a careful reader.", *DOCS, "Question: Where does Mira live?\nAnswer:"]
    whole = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    return prompt, whole.text, whole.token_ids


def test_stop_strings_end_the_output_in_generate_and_stream(llm: LLM) -> None:
    """vLLM's stop strings offline: the text ends before the first one (after it with
    include_stop_str_in_output), decoding ends at the token that completed it, stop_reason names it;
    in a batch, the other prompts go on to their own end."""
    prompt, text, ids = _long_answer(llm)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    want = text[:text.index(stop)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop, "never in it"])
    out = llm.generate([prompt], sp)[0]
    assert out.text == want and out.finish_reason == "stop" and out.stop_reason == stop
    assert ids[:len(out.token_ids)] == out.token_ids and len(out.token_ids) < len(ids)
    assert stop in llm.tokenizer.decode(out.token_ids) and stop not in llm.tokenizer.decode(out.token_ids[:-1])
    kept = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, stop=stop,
                                                 include_stop_str_in_output=True))[0]
    assert kept.text == text[:text.index(stop) + len(stop)] and kept.token_ids == out.token_ids
    deltas = list(llm.stream(prompt, sp))
    assert "".join(d.text for d in deltas) == want and deltas[-1].output.finish_reason == "stop"
    assert deltas[-1].output.token_ids == out.token_ids and deltas[-1].output.stop_reason == stop
    both = llm.generate([prompt, prompt], [sp, SamplingParams(max_tokens=24, ignore_eos=True)])
    assert both[0].text == want and both[1].text == text and both[1].token_ids == ids
    assert both[1].finish_reason == "length" and both[1].stop_reason is None


def test_vllm_shaped_outputs_and_arguments(llm: LLM) -> None:
    """``sampling_params=``, ``outputs[0]``, ``prompt_token_ids``, a stop token's id as the stop_reason,
    logprobs 0 (the sampled token's alone) and None (off), special tokens shown on request."""
    prompt, text, ids = _long_answer(llm)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    out = llm.generate([prompt], sampling_params=sp)[0]
    assert out.outputs[0] is out and out.outputs[0].text == text
    assert out.prompt_token_ids == [t for s in llm.tokenize(prompt) for t in s]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([prompt], sp, sampling_params=sp)
    stopped = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[ids[5]]))[0]
    assert stopped.token_ids == ids[:ids.index(ids[5]) + 1] and stopped.stop_reason == ids[5]
    assert stopped.text == llm.tokenizer.decode(stopped.token_ids[:-1])
    sampled = llm.generate([prompt], SamplingParams(max_tokens=4, logprobs=0))[0]
    assert [list(lp) for lp in sampled.logprobs] == [[t] for t in sampled.token_ids]
    assert llm.generate([prompt], SamplingParams(max_tokens=4))[0].logprobs is None
    end = llm.tokenizer.token_to_id("<|end|>")
    forced = SamplingParams(max_tokens=3, ignore_eos=True, logit_bias={end: 100})
    assert llm.generate("Say", forced)[0].text == ""
    shown = llm.generate("Say", SamplingParams(max_tokens=3, ignore_eos=True, logit_bias={end: 100},
                                               skip_special_tokens=False))[0]
    assert shown.text == "<|end|>" * 3
    for kw, needle in (({"stop": [""]}, "stop"), ({"stop": 5}, "stop"), ({"skip_special_tokens": 1}, "skip_special"),
                       ({"logprobs": -1}, "logprobs"), ({"max_tokens": 0}, "max_tokens")):
        with pytest.raises(ValueError, match=needle):
            SamplingParams(**kw)
