"""A tiktoken BPE file (``tiktoken.model``: a base64 token and its rank per line) as a ``tokenizers``
tokenizer, for checkpoints that ship one instead of ``tokenizer.json`` — Kimi-Linear's, with remote
code around it (``tokenization_kimi.py``) that hypic does not run.

tiktoken's BPE merges, inside each piece its split pattern cuts, the adjacent pair whose join has the
lowest rank, until none is in the table, and takes a piece that is a token whole. A ``tokenizers``
BPE applies merges in list order by the same rule, so every split of a token into two tokens becomes
a merge, listed by the token's rank, and the BPE looks a piece up first (``ignore_merges``), as
transformers' TikToken converter builds it. Bytes map to characters as byte-level BPE does (GPT-2's table), the split
pattern is the model's (``KIMI_PATTERN``, from its remote code), and the special tokens are
tokenizer_config.json's ``added_tokens_decoder``, whose ids continue after the ranks.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# The split pattern of Kimi's tokenizer (Kimi-K2, Kimi-Linear: ``pat_str`` in tokenization_kimi.py).
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
PATTERNS = {"kimi_linear": KIMI_PATTERN}  # model_type → its split pattern


def byte_chars() -> list[str]:
    """Byte-level BPE's printable character for each byte (GPT-2's table: printable Latin-1 bytes map
    to themselves, the rest to code points from 256 up, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for k, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ValueError(f"{path}: line {k + 1} is not '<base64 token> <rank>'") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0 … {len(ranks) - 1}, each once")
    return ranks


def tiktoken_tokenizer(path: Path, pattern: str, special: dict[int, str]) -> Tokenizer:
    """``path`` (tiktoken.model) as a byte-level BPE ``Tokenizer`` splitting by ``pattern``, with the
    ``special`` tokens (id → text) after the ranks."""
    ranks = read_ranks(path)
    chars = byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    # tiktoken merges, in a piece, the adjacent pair whose join has the lowest rank, and takes a piece
    # that is a token whole: so every split of a token into two tokens is a merge, in the order of the
    # token's rank, and ``ignore_merges`` looks a piece up first, as transformers' TikTokenConverter
    # does. (Deriving one merge per token refused vocabularies tiktoken loads: a token that is not
    # two lower-ranked ones joined, as Llama-3's " Việt".) Where two splits of one token both appear
    # in a piece, tiktoken takes the leftmost and this the split of lower-ranked parts.
    merges = []
    for token in sorted(ranks, key=ranks.__getitem__):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(text(a), text(b)) for a, b in sorted(splits, key=lambda p: (ranks[p[0]], ranks[p[1]]))]
    bpe = models.BPE(vocab={text(t): r for t, r in ranks.items()}, merges=merges, fuse_unk=False, ignore_merges=True)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    first = len(ranks)
    if special:
        if min(special) < first:
            raise ValueError(f"special tokens: id {min(special)} is a BPE rank (ids from {first} on are free)")
        names = [special.get(i, f"<|reserved_token_{i}|>") for i in range(first, max(special) + 1)]
        tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    return tok


def special_tokens(tokenizer_config: dict[str, Any]) -> dict[int, str]:
    """tokenizer_config.json's ``added_tokens_decoder``: id → text."""
    out = {}
    for key, value in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        content = value.get("content") if isinstance(value, dict) else value
        if isinstance(content, str) and str(key).isdigit():
            out[int(key)] = content
    return out
