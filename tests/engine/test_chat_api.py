"""``LLM.chat``: conversations through the model's chat template, each message its own segment —
so documents sent as messages hit the cache wherever they sit — the same tokens the server's chat
route builds, batches of conversations, text parts, structured output; bad input refused by name."""

import json

import pytest

from hypic import LLM, SamplingParams

pytest.importorskip("jinja2")  # chat templating's; the GPU machine's environment may lack it
from hypic.server.chat import ChatTemplate  # noqa: E402

DOCS = ["Profile of Mira. Mira lives in Quorvane and keeps bees on the roof.",
        "Profile of Tal. Tal plays the harp in Westvale every evening."]
SYSTEM = {"role": "system", "content": "You are a careful reader."}
QUESTION = {"role": "user", "content": "Question: Where does Mira live?"}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")  # a CPU test wherever it runs (on a GPU LLM() is bf16)


def _conversation(order: list[int]) -> list[dict]:
    return [SYSTEM, *({"role": "user", "content": DOCS[i]} for i in order), QUESTION]


def test_documents_sent_as_messages_hit_the_cache_in_any_order(llm: LLM) -> None:
    first = llm.chat(_conversation([0, 1]), SamplingParams(max_tokens=6))[0]
    again = llm.chat(_conversation([1, 0]), SamplingParams(max_tokens=6))[0]
    assert first.metrics.segment_misses >= 2 and again.metrics.segment_hits >= 2
    # the prompt is the template's render, cut where the server cuts it
    template = ChatTemplate.from_model(llm.loaded.tokenizer_config, llm.loaded.path)
    texts = [s.text for s in template.segments([(m["role"], [m["content"]]) for m in _conversation([1, 0])])]
    same = llm.generate([texts], SamplingParams(max_tokens=6), mode="full")[0]
    assert same.token_ids == llm.chat(_conversation([1, 0]), SamplingParams(max_tokens=6), mode="full")[0].token_ids


def test_a_batch_of_conversations_text_parts_and_structured_output(llm: LLM) -> None:
    parts = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": d} for d in DOCS]}, QUESTION]
    outs = llm.chat([_conversation([0]), parts], SamplingParams(max_tokens=60, json_schema={"type": "object"}),
                    chat_template_kwargs={"enable_thinking": False})
    assert len(outs) == 2
    for out in outs:
        assert out.finish_reason == "length" or isinstance(json.loads(out.text), dict)
    assert outs[1].metrics.segment_hits + outs[1].metrics.segment_misses >= 2  # one segment per text part


@pytest.mark.parametrize("conversations, needle", [
    ([], "conversations"),
    ([{"content": "hi"}], r"conversations\[0\]\[0\]\.role"),
    ([{"role": "user", "content": 5}], r"conversations\[0\]\[0\]\.content"),
    ([{"role": "wizard", "content": "hi"}], r"conversations\[0\]\[0\]\.role: expected one of"),  # as the server
    ([{"role": "user"}], r"conversations\[0\]\[0\]\.content: a user message needs content"),
    ([{"role": "assistant"}], r"conversations\[0\]\[0\]\.content: an assistant message needs content"),
    ([[SYSTEM], "not a conversation"], r"conversations\[1\]"),
])
def test_bad_conversations_are_refused_by_name_and_the_model_goes_on(llm: LLM, conversations, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        llm.chat(conversations)
    assert llm.chat([QUESTION], SamplingParams(max_tokens=2))[0].token_ids
