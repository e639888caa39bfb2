"""Parity harness: tiny random transformers models saved as real checkpoints, loaded by hypic,
compared on prefill logits and greedy decoding."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hypic.models.context import SequenceContext, SequenceState
from hypic.models.decode_batch import gather
from hypic.models.loader import LoadedModel

TINY_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)
TINY_BASE = dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, max_position_embeddings=4096)
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)


def randomize_norms(model: torch.nn.Module, scale: float = 0.1, seed: int = 0) -> None:
    """Zero- or one-initialised norm weights would hide a wrong (1 + w) vs w convention."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(scale * torch.randn(p.shape, generator=gen))


def save_checkpoint(model: torch.nn.Module, path: Path, max_shard_size: str | None = None) -> Path:
    os.makedirs(path, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path


@torch.no_grad()
def hypic_logits(loaded: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """Prefill logits of every token of one sequence."""
    ctx = SequenceContext([SequenceState()], [len(ids)], loaded.device)
    return loaded.model(ids.to(loaded.device), ctx)


@torch.no_grad()
def hypic_greedy(loaded: LoadedModel, prompts: list[torch.Tensor], steps: int,
                 stacked: bool = False) -> tuple[list[list[int]], torch.Tensor]:
    """Batched greedy decode: one varlen prefill of all prompts, then batched one-token steps, each
    sequence continuing its own state (``SequenceContext``) or, ``stacked``, the states kept stacked
    between steps (``DecodeBatch``, what the engine runs). Returns each sequence's tokens and the
    logits of every step [steps, N, vocab]."""
    model, dev = loaded.model, loaded.device
    states = [SequenceState() for _ in prompts]
    ctx = SequenceContext(states, [len(p) for p in prompts], dev)
    logits = model(torch.cat(prompts).to(dev), ctx, model.last_token_rows(ctx.cu_seqlens).to(dev))
    ctx.finish()
    tokens, all_logits = [[] for _ in prompts], []
    for _ in range(steps):
        all_logits.append(logits)
        nxt = logits.argmax(-1)
        for t, n in zip(tokens, nxt.tolist(), strict=True):
            t.append(n)
        if stacked:
            batch, slots = gather(states, dev)
            assert slots == list(range(len(prompts)))
            logits = batch.step(model, nxt.tolist())
        else:
            ctx = SequenceContext(states, [1] * len(prompts), dev)
            logits = model(nxt, ctx)
            ctx.finish()
    return tokens, torch.stack(all_logits)


@torch.no_grad()
def hf_greedy(ref: torch.nn.Module, prompt: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    out = ref.generate(prompt[None], max_new_tokens=steps, do_sample=False, output_logits=True,
                       return_dict_in_generate=True, min_new_tokens=steps, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0]


def assert_prefill_matches_transformers(ref: torch.nn.Module, loaded: LoadedModel, *, length: int = 300,
                                        seed: int = 1, tol: float = 1e-4) -> None:
    ids = torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    assert (hypic_logits(loaded, ids) - expected).abs().max() <= tol


def assert_greedy_matches_transformers(ref: torch.nn.Module, loaded: LoadedModel, *, steps: int = 20, seed: int = 2,
                                       tol: float = 1e-4) -> None:
    prompt = torch.randint(3, 512, (37,), generator=torch.Generator().manual_seed(seed))
    want, want_logits = hf_greedy(ref, prompt, steps)
    for stacked in (False, True):
        got, got_logits = hypic_greedy(loaded, [prompt], steps, stacked)
        assert got[0] == want
        assert (got_logits[:, 0] - want_logits).abs().max() <= tol


def assert_varlen_equals_alone(loaded: LoadedModel, *, seed: int = 3, tol: float = 1e-5) -> None:
    """Two sequences in one varlen batch (prefill and decode) give what each gives alone."""
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randint(3, 512, (70,), generator=gen), torch.randint(3, 512, (129,), generator=gen)
    for stacked in (False, True):  # sequences of different lengths in one stacked batch: each masked to its own
        both_tokens, both_logits = hypic_greedy(loaded, [a, b], 5, stacked)
        for i, p in enumerate((a, b)):
            alone_tokens, alone_logits = hypic_greedy(loaded, [p], 5)
            assert both_tokens[i] == alone_tokens[0]
            assert (both_logits[:, i] - alone_logits[:, 0]).abs().max() <= tol
