"""Segment-preserving chat templating and incremental detokenization (no server needed)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from hypic.server.chat import ChatTemplate
from hypic.server.text import TextStream

DEFAULT_SYSTEM = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
                  "{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NEEDS_USER_LAST = ("{% if messages[-1]['role'] != 'user' %}{{ raise_exception('the last message must be a user''s') }}"
                   "{% endif %}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}[/]{% endfor %}")


def texts(template: ChatTemplate, messages: list[tuple[str, list[str]]]) -> list[str]:
    return [s.text for s in template.segments(messages)]


def test_chatml_each_message_and_part_is_a_segment() -> None:
    t = ChatTemplate()
    got = t.segments([("system", ["S"]), ("user", ["A"]), ("user", ["B", "C", "Q"])])
    assert [s.text for s in got] == ["<|im_start|>system\nS<|im_end|>\n", "<|im_start|>user\nA<|im_end|>\n",
                                     "<|im_start|>user\n", "B\n", "C\n", "Q<|im_end|>\n<|im_start|>assistant\n"]
    assert [s.message for s in got] == [0, 1, 2, 2, 2, 2]
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "A"},
             {"role": "user", "content": "B\nC\nQ"}]
    assert "".join(s.text for s in got) == t.render(plain, True)


def test_developer_is_system_unless_the_template_names_it() -> None:
    assert texts(ChatTemplate(), [("developer", ["D"]), ("user", ["Q"])])[0] == "<|im_start|>system\nD<|im_end|>\n"
    own = ChatTemplate("{% for m in messages %}{% if m.role == 'developer' %}[dev]{% endif %}"
                       "<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert texts(own, [("developer", ["D"]), ("user", ["Q"])]) == ["[dev]<developer>D", "<user>Q"]


def test_a_document_is_the_same_segment_wherever_it_sits() -> None:
    t = ChatTemplate()
    docs = [("user", ["doc one"]), ("user", ["doc two"]), ("user", ["doc three"])]
    a = texts(t, [("system", ["S"]), *docs, ("user", ["Q"])])
    b = texts(t, [("system", ["S"]), *docs[::-1], ("user", ["Q"])])
    assert sorted(a[1:-1]) == sorted(b[1:-1]) and a[0] == b[0] and a[-1] == b[-1]
    parts = texts(t, [("user", ["doc one", "doc two", "Q"])]), texts(t, [("user", ["doc two", "doc one", "Q"])])
    assert sorted(parts[0][1:-1]) == sorted(parts[1][1:-1])


def test_template_extras_stay_with_their_message() -> None:
    t = ChatTemplate(DEFAULT_SYSTEM)  # injects a system message and trims content
    assert texts(t, [("user", ["  A  "]), ("user", ["Q"])]) == [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nA<|im_end|>\n",
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"]


def test_a_template_refusing_partial_conversations_falls_back_to_content_starts() -> None:
    t = ChatTemplate(NEEDS_USER_LAST)  # rendering [system] alone raises: cut at the user content instead
    assert texts(t, [("system", ["S"]), ("user", ["A"]), ("user", ["Q"])]) == ["[system]S[/][user]", "A[/]",
                                                                              "[user]Q[/]"]
    with pytest.raises(ValueError, match="messages: the chat template refused"):
        t.segments([("user", ["A"]), ("assistant", ["B"])])


# Qwen3's way with an assistant's earlier answer: only the text after </think> is kept
CUTS_THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                 "{{ m['content'].split('</think>')[-1].lstrip('\n') }}{% else %}{{ m['content'] }}{% endif %}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("source", [
    CUTS_THINKING,
    "{% for m in messages %}{{ m['role'] }};{% endfor %}",  # drops content
    "{% for m in messages %}{{ m['content'] }}{{ m['content'] }}|{% endfor %}",  # repeats it
])
def test_templates_that_rewrite_content_are_cut_where_messages_end(source: str) -> None:
    """Where the content cannot be found once as sent (Qwen3 keeps what follows </think>), the
    prompt is cut where the render of each leading run of messages ends: it was refused (a 400 for
    a client sending the server's own answer back)."""
    t = ChatTemplate(source)
    messages = [("user", ["hi"]), ("assistant", ["<think>\nhm\n</think>\n\nHello"]), ("user", ["again"])]
    got = t.segments(messages)
    plain = t.render([{"role": r, "content": p[0]} for r, p in messages], True)
    assert "".join(s.text for s in got) == plain and len(got) == 3
    assert [s.message for s in got] == [0, 1, 2]
    assert got[0].text == t.render([{"role": "user", "content": "hi"}], False)


def test_transformers_tojson_arguments_and_a_templates_own_errors() -> None:
    """Kimi's templates write tools with tojson(separators=…): a TypeError, and any error that was
    not jinja's was a 500 where it is the request's (a 400)."""
    t = ChatTemplate("{{ tools | tojson(separators=(',', ':'), sort_keys=True) }}{% for m in messages %}"
                     "{{ m['content'] }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    assert t.render([{"role": "user", "content": "hi"}], True, {"tools": tools}).startswith(
        '[{"function":{"name":"f","parameters":{"a":2,"b":1}},"type":"function"}]')
    with pytest.raises(ValueError, match="messages: the chat template refused them: TypeError"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "x"}], True)
    # any error of the template's on these messages (a review found a division by a count a 500)
    with pytest.raises(ValueError, match="refused them: ZeroDivisionError"):
        ChatTemplate("{{ 1 // (messages[0]['content'] | length - 2) }}").render([{"role": "user", "content": "hi"}],
                                                                                True)


def test_template_from_a_model_folder(tmp_path: Path) -> None:
    cfg = {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "<{{ messages[0]"
                                                                                                    "['content'] }}>"}],
           "eos_token": {"content": "</s>"}}
    assert texts(ChatTemplate.from_model(cfg), [("user", ["A"])]) == ["<A>"]
    (tmp_path / "chat_template.jinja").write_text("[{{ messages[0]['content'] }}]{{ eos_token }}")
    assert texts(ChatTemplate.from_model(cfg, tmp_path), [("user", ["A"])]) == ["[A]</s>"]
    assert ChatTemplate.from_model({}).source.startswith("{% for message in messages %}<|im_start|>")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))  # byte-level BPE: multi-byte characters span tokens


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_incremental_text_equals_decoding_everything(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(rng.randrange(1, 40))]
    stream = TextStream(tokenizer)
    pieces = [stream.push(t) for t in ids] + [stream.finish()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_multibyte_characters_are_never_split(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("naïve café — 東京 🙂 done", add_special_tokens=False).ids
    stream = TextStream(tokenizer)
    pieces = [stream.push(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) + stream.finish() == " naïve café — 東京 🙂 done"


@pytest.mark.parametrize("stops, want", [(["café"], " naïve "), (["zzz"], " naïve café au lait"),
                                         (["au", "ïve"], " na"), (["lait"], " naïve café au ")])
def test_stop_strings_cut_the_text_even_across_tokens(tokenizer: Tokenizer, stops: list[str], want: str) -> None:
    stream = TextStream(tokenizer, stops)
    out = ""
    for t in tokenizer.encode("naïve café au lait", add_special_tokens=False).ids:
        out += stream.push(t)
        if stream.stopped:
            break
    out += stream.finish()
    assert out == want and stream.stopped == (want != " naïve café au lait")
    assert json.dumps(out)  # plain text, nothing held back


@pytest.fixture(scope="module")
def mixed_tokenizer() -> Tokenizer:
    """A byte-level BPE whose merges join a space and a CJK character's first byte (' \\xe5'), as
    real vocabularies do: one token ends a word and begins a multi-byte character."""
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    cjk = "".join(chr(0x4E00 + 7 * i) for i in range(200))
    corpus = [f"Answer: {cjk[i:i + 3]} and {cjk[i + 5:i + 7]} is here" for i in range(190)] * 5
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def test_a_stop_string_before_an_incomplete_character_stops_at_once(mixed_tokenizer: Tokenizer) -> None:
    """The token that completes the stop string also begins a character: the stop is seen on that
    token (it was seen only when the character completed, or at the end: generation ran on to
    max_tokens and the server answered 'length')."""
    tok = mixed_tokenizer
    joined = next(i for i in range(tok.get_vocab_size()) if tok.decode([i]).startswith(" ")
                  and tok.decode([i]).endswith("\ufffd") and tok.decode([i]).strip("\ufffd") == " ")
    word = tok.encode("Answer:", add_special_tokens=False).ids
    stream = TextStream(tok, [": "])
    pieces = [stream.push(t) for t in word]
    assert not stream.stopped
    pieces.append(stream.push(joined))
    assert stream.stopped and "".join(pieces) + stream.finish() == "Answer"
    exempt = TextStream(tok, [" "], min_tokens=len(word) + 1)  # the space is in a token min_tokens exempts
    for t in [*word, joined]:
        exempt.push(t)
    assert not exempt.stopped


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_stop_at_the_first_token_whose_complete_text_holds_them(mixed_tokenizer: Tokenizer,
                                                                            seed: int) -> None:
    """Against decoding everything: the text is cut at the stop's first occurrence, and the stream
    stops at the first token after which the complete characters decoded so far hold it."""
    tok, rng = mixed_tokenizer, random.Random(seed)
    ids = [rng.randrange(1, tok.get_vocab_size()) for _ in range(30)]
    whole = tok.decode(ids)
    start = rng.randrange(len(whole) - 3)
    stop = whole[start:start + 2]
    if "\ufffd" in stop:
        stop = stop.replace("\ufffd", "") or whole[0]
    stream, out, used = TextStream(tok, [stop]), "", 0
    for t in ids:
        out += stream.push(t)
        used += 1
        if stream.stopped:
            break
    out += stream.finish()
    assert stream.stopped and out == whole[:whole.index(stop)]
    first = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]).rstrip("\ufffd"))
    assert used == first


def test_special_tokens_are_text_only_when_kept(tokenizer: Tokenizer) -> None:
    """Kimi's tool-call markers are special tokens: its answers are read with special tokens kept,
    and the end token, a stop there, stays out."""
    ids = tokenizer.encode("Hi<|im_start|> there<|im_end|>", add_special_tokens=False).ids
    end = tokenizer.token_to_id("<|im_end|>")

    def read(stream: TextStream) -> str:
        return "".join(stream.push(t) for t in ids) + stream.finish()

    plain, kept = read(TextStream(tokenizer)), read(TextStream(tokenizer, keep_special=True))
    assert plain == tokenizer.decode(ids, skip_special_tokens=True) and "<|im_" not in plain
    assert kept == tokenizer.decode(ids, skip_special_tokens=False) and kept.endswith("there<|im_end|>")
    assert ids[-1] == end and read(TextStream(tokenizer, stop_ids=(end,), keep_special=True)) == \
        tokenizer.decode(ids[:-1], skip_special_tokens=False)


def test_chat_template_kwargs_reach_the_template_and_keep_segments_apart() -> None:
    """A Qwen3-like switch: ``enable_thinking: false`` closes an empty think block in the generation prompt."""
    source = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
              "{% endif %}")
    t = ChatTemplate(source)
    messages = [("user", ["A"]), ("user", ["Q"])]
    on, off = t.segments(messages), t.segments(messages, {"enable_thinking": False})
    assert [s.text for s in on][0] == [s.text for s in off][0] == "<|im_start|>user\nA<|im_end|>\n"
    assert off[-1].text == on[-1].text + "<think>\n\n</think>\n\n"
