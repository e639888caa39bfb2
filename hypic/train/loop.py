"""The training loop for the bundled model: ``python -m hypic.train --out DIR --minutes 8 [--resume]``.

Qwen3.5 dense architecture (GDN layers, every 4th full attention), trained with hypic's own model
code and the chunked PyTorch linear-attention kernel (differentiable; fla's backward does not run
on the GPU machine's Triton). bf16 autocast on CUDA, AdamW with warm-up and cosine decay over
``--total-steps``; each run stops after ``--minutes`` and saves a resumable checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from hypic.eval.tokenizer import END, END_OF_TEXT
from hypic.models.context import SequenceContext, SequenceState
from hypic.models.loader import resolve_device
from hypic.models.random_init import random_model
from hypic.ops.linear import backend_override
from hypic.ops.transfer import to_device
from hypic.train.args import check, check_out, parse_weights, parser
from hypic.train.blind import QueryBlindContext
from hypic.train.checkpoint import load_checkpoint, save_checkpoint, tokenizer_config
from hypic.train.data import Stream, difficulty_at
from hypic.train.pic import StandaloneSegmentsContext


def model_config(tok: Tokenizer, preset: str) -> dict:
    vocab = 64 * math.ceil(tok.get_vocab_size() / 64)
    sizes = {"tiny": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, heads=2, kv=1, hd=32),
             "default": dict(hidden_size=256, num_hidden_layers=8, intermediate_size=512, heads=4, kv=2, hd=64)}
    s = sizes[preset]
    return dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=vocab,
                hidden_size=s["hidden_size"], num_hidden_layers=s["num_hidden_layers"], full_attention_interval=4,
                num_attention_heads=s["heads"], num_key_value_heads=s["kv"], head_dim=s["hd"],
                intermediate_size=s["intermediate_size"], linear_num_key_heads=s["heads"],
                linear_num_value_heads=s["heads"], linear_key_head_dim=s["hd"], linear_value_head_dim=s["hd"],
                linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                tie_word_embeddings=True, attn_output_gate=True, hidden_act="silu",
                eos_token_id=tok.token_to_id(END), pad_token_id=tok.token_to_id(END_OF_TEXT),
                bos_token_id=None, torch_dtype="float32")


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine to a tenth of ``peak`` at ``total``;
    ``step`` counts from the schedule's start (a negative one would warm up backwards: a negative
    learning rate, i.e. gradient ascent)."""
    if step < 0:
        raise ValueError(f"learning-rate schedule asked for step {step}, before its start")
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def loss_of(model: torch.nn.Module, batch, device: torch.device,
            standalone: bool = False, seam: int = 0, blind: bool = False,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weighted loss, teacher-forced accuracy on the answer tokens, on answers' first tokens): the
    accuracies are the signal that retrieval is being learned (the first token most of all); the
    loss alone mixes in the documents' language modelling.
    ``standalone``: the forward hypic makes at seam ``seam`` — segments before the query computed
    on their own, their first ``seam`` tokens again in context (``hypic.train.pic``); ``blind``: the
    query onward attends only to itself, the documents reach it through the linear layers
    (``hypic.train.blind``)."""
    if standalone and blind:
        raise ValueError("a step is standalone or query-blind, not both")
    ids, labels, w, first = batch.input_ids, batch.labels, batch.weights, batch.first
    if standalone:
        ctx = StandaloneSegmentsContext(batch.lengths, batch.segments, device, seam=seam)
        # physical rows: seam copies scored 0 (their tokens are scored once, in the cold prefill)
        ids, labels, w = ids[ctx.source], labels[ctx.source], w[ctx.source] * ~ctx.seam_copy
        first = first[ctx.source] & ~ctx.seam_copy
    elif blind:
        ctx = QueryBlindContext(batch.lengths, batch.segments, device)
    else:
        ctx = SequenceContext([SequenceState() for _ in batch.lengths], batch.lengths, device, keep_state=False)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        hidden = model.hidden_states(to_device(ids, device), ctx)
        logits = model.lm_head(hidden).float()
    labels = to_device(labels, device)
    nll = F.cross_entropy(logits, labels, reduction="none")
    w = to_device(w, device, None)
    answer = w == 1.0  # masked sums, not boolean indexing: nothing here may wait for the GPU
    right = logits.argmax(-1) == labels
    accuracy = (right & answer).sum() / answer.sum().clamp_min(1)
    first = to_device(first, device, None)
    first_accuracy = (right & first).sum() / first.sum().clamp_min(1)
    return (nll * w).sum() / w.sum(), accuracy.detach(), first_accuracy.detach()


def train(args: argparse.Namespace) -> dict:
    check(args)
    check_out(args)
    out = Path(args.out)
    tok_file = Path(args.tokenizer) / "tokenizer.json" if args.tokenizer else out / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_file))
    device = resolve_device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 recurrence's matmuls: TF32 is ample for training
    config = json.loads((out / "config.json").read_text()) if args.resume else model_config(tok, args.preset)
    model = random_model(config, device=device, dtype=torch.float32, seed=args.seed).model.train()
    model.requires_grad_(True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    state = {"step": 0, "tokens": 0, "log": []}
    if args.resume:
        state = load_checkpoint(out, model, opt)
        state.pop("stopped", None)  # an earlier run's early stop is not this one's
    # a first run's folder files, written with its first save: a run that fails before then leaves --out as it was
    files = {} if args.resume else {
        "tokenizer.json": tok_file.read_bytes(),
        "tokenizer_config.json": json.dumps(tokenizer_config(config, tok, {"model_max_length": 32768})).encode()}
    stream = Stream(tok, batch_tokens=args.batch_tokens, seed=args.seed, ramp_steps=args.ramp_steps,
                    doc_weight=args.doc_weight, workers=args.workers, extra=args.extra_questions,
                    extra_multi=args.extra_multi, family_weights=parse_weights(args.family_weights),
                    easy_share=args.easy_share, easy_max=args.easy_max)
    t0, last, logged_tokens = time.time(), time.time(), state["tokens"]
    try:
        with backend_override("torch"):
            while time.time() - t0 < args.minutes * 60 and state["step"] < args.total_steps:
                step = state["step"]
                batch = stream.batch(step)
                for g in opt.param_groups:
                    g["lr"] = lr_at(step - args.schedule_start, args.lr, args.warmup,
                                    args.total_steps - args.schedule_start)
                standalone = args.standalone_every > 0 and step % args.standalone_every == 0
                # query-blind steps fall on the last of every --blind-every steps, when that is no standalone one
                blind = (not standalone and args.blind_every > 0
                         and step % args.blind_every == args.blind_every - 1)
                loss, accuracy, first = loss_of(model, batch, device, standalone, args.standalone_seam, blind)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                state["step"] += 1
                state["tokens"] += int(batch.input_ids.numel())
                if state["step"] % args.log_every == 0:
                    dt = time.time() - last
                    last = time.time()
                    row = {"step": state["step"], "loss": round(loss.item(), 4),
                           "answer_acc": round(accuracy.item(), 3), "first_acc": round(first.item(), 3),
                           "standalone": standalone, "blind": blind, "grad_norm": round(norm.item(), 3),
                           "lr": g["lr"], "difficulty": round(difficulty_at(step, args.ramp_steps), 3),
                           "tok_per_s": round((state["tokens"] - logged_tokens) / dt)}
                    logged_tokens = state["tokens"]
                    if device.type == "cuda":  # the peak so far: headroom for larger --batch-tokens
                        row["mem_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 1)
                    state["log"].append(row)
                    print(json.dumps(row), flush=True)
    except torch.OutOfMemoryError:
        # A step that runs out of memory fails in its forward or backward, before opt.step: the model
        # and optimizer are still those of the last finished step, so a device run keeps its progress.
        state["stopped"] = f"out of memory at step {state['step']} (--batch-tokens {args.batch_tokens})"
        print(json.dumps({"step": state["step"], "stopped": state["stopped"]}), flush=True)
    finally:
        stream.close()
    save_checkpoint(out, model, opt, state, config, files)
    return state


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    try:
        state = train(args)
    except ValueError as e:  # the checks name the option or file at fault: one line, not a traceback
        print(f"hypic.train: {e}", file=sys.stderr)
        return 2
    return 1 if "stopped" in state else 0
