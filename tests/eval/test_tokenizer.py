"""Tokenizer: trains fast on the suite, saves and reloads, and keeps answers as the same tokens as in documents."""

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from hypic.eval.tasks import generate
from hypic.eval.tokenizer import END, END_OF_TEXT, corpus, encode_example, train_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    trained = train_tokenizer(corpus(2, seeds=(-1, -2), difficulties=(0.0, 0.5), trace_requests=0), 2048)
    path = Path(tmp_path_factory.mktemp("tok")) / "tokenizer.json"
    trained.save(str(path))
    return Tokenizer.from_file(str(path))  # what the engine's loader does


def contains(haystack: list[int], needle: list[int]) -> bool:
    return any(haystack[i:i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


def test_special_tokens(tok: Tokenizer) -> None:
    assert tok.token_to_id(END_OF_TEXT) == 0 and tok.token_to_id(END) == 1
    assert tok.encode(f"harp{END}", add_special_tokens=False).ids[-1] == 1


def test_round_trip(tok: Tokenizer) -> None:
    ex = generate("report_summary", 1, seed=3, difficulty=0.5)[0]
    for text in ex.segments:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == " " + text  # the one change: the leading space every segment gets


def test_words_tokenize_alike_at_segment_start_and_inside(tok: Tokenizer) -> None:
    alone = tok.encode("Quorvane", add_special_tokens=False).ids
    inside = tok.encode("Mira lives in Quorvane", add_special_tokens=False).ids
    assert inside[-len(alone):] == alone


@pytest.mark.parametrize("family", ["single_hop", "multi_hop"])
def test_answer_tokens_are_a_contiguous_run_of_document_tokens(tok: Tokenizer, family: str) -> None:
    for ex in generate(family, 40, seed=100, difficulty=0.5):  # seeds the tokenizer never saw
        enc = encode_example(tok, ex)
        answer = enc.target[:-1]
        assert enc.target[-1] == tok.token_to_id(END)
        assert tok.decode(answer).strip() == ex.answer
        assert contains(enc.segments[ex.support[-1]], answer)
        assert len(enc.segments) == len(ex.segments)
