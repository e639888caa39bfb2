"""A tiktoken BPE file as a ``tokenizers`` tokenizer (Kimi-Linear ships one): Kimi's split pattern
cuts text as tiktoken's regex does; a byte-level BPE written out as a tiktoken file and converted
back encodes and decodes every text as the original; special tokens keep their ids; a Kimi-Linear
folder with ``tiktoken.model`` and no tokenizer.json loads with a tokenizer."""

from __future__ import annotations

import base64
import json
import random

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from hypic.models.loader import load_model
from hypic.models.tiktoken_file import KIMI_PATTERN, byte_chars, tiktoken_tokenizer
from tests.models.test_kimi_linear import tiny_kimi

TEXTS = ["Hello world's 12345 你好世界", "The mill's wheel turned; 3.14159 and 2,718 were noted.\n\nOK?",
         "Quorvane — a city of bees 🐝 and harps.\tTabs\r\nCRLF", "  leading and trailing spaces  ",
         "I'VE SEEN IT, they'll say. naïve café, Ärger; ÆØÅ", "def f(x):\n    return x ** 2  # 平方"]


def test_kimi_pattern_cuts_as_tiktoken_does() -> None:
    pieces = [p for p, _ in pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated")
              .pre_tokenize_str("Hello world's 12345 你好世界\n\nOK THE'S end  ")]
    # by the pattern's alternatives, in order: Han runs; letters with an optional lead and contraction
    # (lower-case tail, then upper-case head); 1–3 digits; punctuation runs; newlines; spaces
    assert pieces == ["Hello", " world's", " ", "123", "45", " ", "你好世界", "\n\n", "OK", " THE'S", " end", "  "]


def _trained(vocab: int = 700) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    rng = random.Random(0)
    syllables = ["qu", "or", "va", "ne", "mi", "ra", "tal", "west", "ble", "ing", "ed", "s", "th", "er", "an",
                 "平", "方", "城", "市", "ÿ", "é", "42", "7", "!", "'s", "'ll"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    corpus = [" ".join(rng.choice(words) for _ in range(30)) + rng.choice(TEXTS) for _ in range(400)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _write_tiktoken(tok: Tokenizer, path) -> None:
    back = {c: b for b, c in enumerate(byte_chars())}
    lines = [f"{base64.b64encode(bytes(back[c] for c in token)).decode()} {rank}"
             for token, rank in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    path.write_text("\n".join(lines) + "\n")


def test_a_bpe_written_as_a_tiktoken_file_converts_back_to_the_same_encodings(tmp_path) -> None:
    original = _trained()
    _write_tiktoken(original, tmp_path / "tiktoken.model")
    converted = tiktoken_tokenizer(tmp_path / "tiktoken.model", KIMI_PATTERN, {})
    assert converted.get_vocab_size() == original.get_vocab_size() > 256 + 300  # many merges to get right
    rng = random.Random(1)
    texts = TEXTS + ["".join(rng.choice(" ".join(TEXTS)) for _ in range(80)) for _ in range(50)]
    for text in texts:
        ids = original.encode(text).ids
        assert converted.encode(text).ids == ids, text
        assert converted.decode(ids) == text


def _tiktoken_encode(ranks: dict[bytes, int], piece: bytes) -> list[int]:
    """tiktoken's rule, written from its description (tiktoken/_educational.py): a piece that is a
    token is that token; else, from its bytes, the adjacent pair whose join has the lowest rank is
    merged (the leftmost of equals) until no join is a token."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while True:
        joins = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1) if parts[i] + parts[i + 1] in ranks]
        if not joins:
            return [ranks[p] for p in parts]
        _, i = min(joins)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def test_any_vocabulary_tiktoken_loads_encodes_as_tiktoken_does(tmp_path) -> None:
    """Vocabularies tiktoken accepts but that are no BPE's training output: tokens joined from any
    two earlier ones (so one token has several splits) and tokens no merge builds (Llama-3's " Việt"
    case: a whole piece looked up). 20 random vocabularies × 60 texts from their own alphabet."""
    split = pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated")
    for seed in range(20):
        rng = random.Random(seed)
        alphabet = [c.encode() for c in "abcde "] + ["é".encode(), "平".encode()]
        vocab = [bytes([b]) for b in range(256)]
        while len(vocab) < 256 + 120:
            if rng.random() < 0.2:  # bytes no pair of tokens joins to, as tiktoken files may hold
                token = b"".join(rng.choice(alphabet) for _ in range(rng.randint(3, 6)))
            else:
                token = rng.choice(vocab[97:] if rng.random() < 0.7 else vocab) + rng.choice(vocab[97:])
            if token not in vocab:
                vocab.append(token)
        ranks = {t: r for r, t in enumerate(vocab)}
        path = tmp_path / f"v{seed}.model"
        path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
        tok = tiktoken_tokenizer(path, KIMI_PATTERN, {})
        for _ in range(60):
            text = b"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))).decode()
            want = [i for piece, _ in split.pre_tokenize_str(text) for i in _tiktoken_encode(ranks, piece.encode())]
            assert tok.encode(text).ids == want, (seed, text)
            assert tok.decode(want) == text


def test_special_tokens_keep_their_ids(tmp_path) -> None:
    original = _trained(300)
    _write_tiktoken(original, tmp_path / "tiktoken.model")
    first = original.get_vocab_size()
    tok = tiktoken_tokenizer(tmp_path / "tiktoken.model", KIMI_PATTERN,
                             {first: "[BOS]", first + 1: "[EOS]", first + 3: "<|im_end|>"})
    ids = tok.encode("Hi<|im_end|>").ids
    assert ids[-1] == first + 3 and tok.token_to_id(f"<|reserved_token_{first + 2}|>") == first + 2
    assert tok.decode(ids, skip_special_tokens=True) == "Hi"
    with pytest.raises(ValueError, match="BPE rank"):
        tiktoken_tokenizer(tmp_path / "tiktoken.model", KIMI_PATTERN, {first - 1: "[X]"})


def test_a_malformed_file_is_refused_by_line(tmp_path) -> None:
    (tmp_path / "bad.model").write_text("QQ== 0\nnot-base64 1\n")
    with pytest.raises(ValueError, match="line 2"):
        tiktoken_tokenizer(tmp_path / "bad.model", KIMI_PATTERN, {})


def test_a_kimi_linear_folder_with_a_tiktoken_file_loads_with_its_tokenizer(tmp_path) -> None:
    ref, _ = tiny_kimi(tmp_path / "kimi")
    original = _trained(400)
    _write_tiktoken(original, tmp_path / "kimi" / "tiktoken.model")
    first = original.get_vocab_size()
    (tmp_path / "kimi" / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(first): {"content": "[BOS]", "special": True},
                                  str(first + 1): {"content": "<|im_end|>", "special": True}}}))
    loaded = load_model(tmp_path / "kimi", device="cpu")
    assert loaded.tokenizer is not None
    assert loaded.tokenizer.encode(TEXTS[0]).ids == original.encode(TEXTS[0]).ids
    assert loaded.tokenizer.token_to_id("<|im_end|>") == first + 1
