"""Whole-model GPU benchmark (never in CI): random-weight bf16 models of the Qwen3.5-9B and
Qwen3.5-35B-A3B shapes; a long prefill and batched decode in hypic, transformers'
``Qwen3_5ForCausalLM`` with the same weights (9B shape only), and this run's bf16 matmul rate.

FLOPs: matmul = 2 × tokens × (every weight of dim ≥ 2 except the embedding and lm_head:
projections, MLP, router, shared expert, depthwise conv; MoE experts at top_k / E) + 2 × rows ×
vocab × hidden for the lm_head rows computed (one per sequence). Attention = 2 (QKᵀ, PV) × 2 ×
(keys seen, summed over queries) × q heads × head_dim per full-attention layer: 2·T²·H·d for a
causal T-token prefill, 4·L·H·d per decode token over L keys. GDN recurrence FLOPs are NOT
counted (as in the reference run). Decode also shows GB/s: active weights (experts: expected
fraction touched) + KV cache read + GDN states read and written.

Run: ``GPU_MODELS=1 bash scripts/gpu_check.sh`` or ``python3 scripts/gpu_models.py --out DIR``;
``--tiny`` runs everything at tiny sizes on the CPU in fp32. Prints a markdown table last and
writes it, with the command, machine and date, to $OUT/models.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hypic.models.context as hctx  # noqa: E402
import hypic.ops.attention as hattn  # noqa: E402
from hypic.models.context import SequenceContext, SequenceState  # noqa: E402
from hypic.models.qwen3_5 import build_qwen3_5  # noqa: E402
from hypic.models.qwen3_next import build_qwen3_5_moe  # noqa: E402

BASE = dict(vocab_size=248320, head_dim=256, num_attention_heads=16, linear_num_key_heads=16,
            linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=262144,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
SHAPES = {
    "9b": dict(BASE, hidden_size=4096, num_hidden_layers=32, num_key_value_heads=4, intermediate_size=12288),
    "35b": dict(BASE, hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2, num_experts=256,
                num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512),
}
TINY = {"9b": dict(intermediate_size=256),
        "35b": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)}
TINY_BASE = dict(vocab_size=512, hidden_size=128, num_hidden_layers=8, head_dim=32, num_attention_heads=4,
                 num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                 linear_value_head_dim=32)


def config(shape: str, tiny: bool) -> dict:
    c = dict(SHAPES[shape], **(dict(TINY_BASE, **TINY[shape]) if tiny else {}))
    c["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                        for i in range(c["num_hidden_layers"])]
    return c


class Timer:
    """Median ms of ``fn`` over ``reps`` calls after ``warmup``: CUDA events on the GPU, a host clock else."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def median(self, fn, reps: int, warmup: int = 1):
        out, times = None, []
        for _ in range(warmup):
            out = fn()
        self.sync()
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = fn()
                b.record()
                times.append((a, b))
            else:
                t0 = time.perf_counter()
                out = fn()
                times.append(1e3 * (time.perf_counter() - t0))
        self.sync()
        return statistics.median([a.elapsed_time(b) for a, b in times] if self.cuda else times), out


def sdpa_4d(q, k, v, *, q_positions, k_positions, scale, causal_prefill=False):
    """hypic.ops.attention.attention with 4-D inputs (SDPA's fused kernels need 4-D; 3-D falls back
    to the math kernel) and enable_gqa instead of repeat_interleave: the suggested fix, patched in."""
    qi, ki, vi = (x.transpose(0, 1)[None] for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if causal_prefill:
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = k_positions[None, :] <= q_positions[:, None]
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def build_hypic(c: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Built on meta and cast there, then given storage on the device once (no fp32 copy)."""
    with torch.device("meta"):
        model = (build_qwen3_5_moe if "num_experts" in c else build_qwen3_5)(c)
    model = model.to(dtype).to_empty(device=device).eval().requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):  # A ∈ [1, 16]
            p.copy_(torch.empty(p.shape, device=device).uniform_(1, 16, generator=gen).log())
        elif name.endswith("dt_bias") or ".linear_attn.norm." in name:
            p.fill_(1.0)
        elif name.endswith("conv1d.weight"):
            p.normal_(0, 0.3, generator=gen)
        else:  # 1-D: zero-centred norms (1 + w)
            p.normal_(0, 0.05 if p.dim() == 1 else 0.02, generator=gen)
    return model


def build_hf(c: dict, model, device: torch.device, dtype: torch.dtype):
    """transformers' Qwen3_5ForCausalLM (SDPA) holding hypic's weights, copied by name."""
    import transformers as T

    with torch.device(device):
        hf = T.Qwen3_5ForCausalLM._from_config(T.Qwen3_5TextConfig(**c), dtype=dtype, attn_implementation="sdpa")
    hf.eval().requires_grad_(False)
    src, dst = model.state_dict(), hf.state_dict()
    if set(src) != set(dst):
        raise ValueError(f"names differ: hypic-only {sorted(set(src) - set(dst))[:3]}, "
                         f"hf-only {sorted(set(dst) - set(src))[:3]}")
    for name, t in src.items():
        dst[name].copy_(t)
    return hf


def counts(model, c: dict) -> dict:
    """Matmul weights used per token (experts at top_k / E) and the bytes of dense and expert weights."""
    frac = c["num_experts_per_tok"] / c["num_experts"] if "num_experts" in c else 1.0
    n = dict(mm=0.0, dense=0, experts=0, frac=frac, head=c["vocab_size"] * c["hidden_size"],
             attn=c["layer_types"].count("full_attention"), lin=c["layer_types"].count("linear_attention"))
    for name, p in model.named_parameters():
        if name.startswith("model.embed_tokens") or name == "lm_head.weight":
            continue
        expert = ".experts." in name
        n["mm"] += p.numel() * (frac if expert else 1.0) if p.dim() >= 2 else 0
        n["experts" if expert else "dense"] += p.numel() * p.element_size()
    return n


def prefill_flops(n: dict, c: dict, lens: list[int]) -> float:
    return (2 * sum(lens) * n["mm"] + 2 * len(lens) * n["head"]
            + n["attn"] * sum(2 * L * L * c["num_attention_heads"] * c["head_dim"] for L in lens))


def decode_cost(n: dict, c: dict, batch: int, keys: int, elem: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step of ``batch`` sequences that have ``keys`` keys each."""
    flops = 2 * batch * (n["mm"] + n["head"]) + n["attn"] * batch * 4 * keys * c["num_attention_heads"] * c["head_dim"]
    touched = 1 - (1 - n["frac"]) ** batch  # expected fraction of the experts a batch reads
    kv = n["attn"] * batch * keys * c["num_key_value_heads"] * c["head_dim"] * 2 * elem
    states = n["lin"] * batch * c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"] * 8
    return flops, n["dense"] + n["head"] * elem + touched * n["experts"] + kv + states


def hypic_prefill(model, ids: list[torch.Tensor], device):
    states = [SequenceState() for _ in ids]
    ctx = SequenceContext(states, [len(x) for x in ids], device)
    logits = model(torch.cat(ids), ctx, model.last_token_rows(ctx.cu_seqlens).to(device))
    ctx.finish()
    return logits, states


def hypic_stepper(model, states, logits, device):
    cur = [logits.argmax(-1)]

    def step():
        ctx = SequenceContext(states, [1] * len(states), device)
        out = model(cur[0], ctx)
        ctx.finish()
        cur[0] = out.argmax(-1)

    return step


def hf_stepper(hf, ids: torch.Tensor):
    out = hf(input_ids=ids[None], use_cache=True, logits_to_keep=1)
    cur = [out.past_key_values, out.logits[:, -1].argmax(-1)]

    def step():
        o = hf(input_ids=cur[1][:, None], past_key_values=cur[0], use_cache=True)
        cur[0], cur[1] = o.past_key_values, o.logits[:, -1].argmax(-1)

    return step


def accuracy(model, hf, ids: torch.Tensor, device) -> tuple[float, float, str, None]:
    """Is a bf16 difference between hypic and transformers bf16 noise? Both against an fp32 copy."""
    import copy

    def rel(x: torch.Tensor, r: torch.Tensor) -> float:
        return ((x.float() - r.float()).norm() / r.float().norm()).item()

    mine = hypic_prefill(model, [ids], device)[0][-1]
    theirs = hf(input_ids=ids[None], use_cache=False, logits_to_keep=1).logits[0, -1]
    exact = copy.deepcopy(model).float()
    truth = hypic_prefill(exact, [ids], device)[0][-1]
    del exact
    note = (f"rel error vs fp32: hypic bf16 {rel(mine, truth):.2e}, transformers bf16 {rel(theirs, truth):.2e}; "
            f"between them {rel(mine, theirs):.2e}")
    return 0.0, 0.0, note, None


def compare(got: torch.Tensor, ref: torch.Tensor) -> str:
    got, ref = got.float().reshape(-1), ref.float().reshape(-1)
    d = got - ref
    return (f"vs transformers: max abs Δ {d.abs().max().item():.3g} (max abs logit {ref.abs().max().item():.3g}), "
            f"rel {(d.norm() / ref.norm()).item():.2e}, top-1 {'same' if got.argmax() == ref.argmax() else 'DIFFERS'}")


class Bench:
    def __init__(self, args, device, dtype) -> None:
        self.args, self.device, self.dtype = args, device, dtype
        self.timer, self.rows, self.rate = Timer(device), [], None

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def case(self, shape: str, name: str, tokens: str, fn):
        """Run ``fn() -> (ms, flops, note, result)`` into a row; a failure (OOM included) becomes a row too."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        result, err = None, None
        try:
            ms, flops, note, result = fn()
        except Exception as e:  # one failing case must not lose the others
            traceback.print_exc()
            err = f"FAILED: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        peak = f"{torch.cuda.max_memory_allocated() / 2**30:.1f}" if self.device.type == "cuda" else "-"
        if err is not None:
            self.rows.append(f"| {shape} | {name} | {tokens} | | | | {peak} | {err} |")
            self.free()
        else:
            tf = flops / ms / 1e9 if ms else 0.0
            rate, pct = (f"{tf:.4g}", f"{100 * tf / self.rate:.0f}%" if self.rate else "") if flops else ("", "")
            self.rows.append(f"| {shape} | {name} | {tokens} | {ms:.2f} | {rate} | {pct} | {peak} | {note} |")
        print(self.rows[-1], flush=True)
        return result

    def matmul(self) -> None:
        n = 256 if self.args.tiny else 8192
        a, b = (torch.randn(n, n, device=self.device, dtype=self.dtype) for _ in range(2))

        def fn():
            ms, _ = self.timer.median(lambda: torch.matmul(a, b), reps=10, warmup=3)
            self.rate = 2 * n**3 / ms / 1e9
            return ms, 2 * n**3, f"{self.dtype} torch.matmul: the rate the % column refers to", None

        self.case("-", "matmul", f"{n}³", fn)

    def profile(self, shape: str, fn) -> None:
        """One prefill under torch.profiler: the kernels by total device time, into $OUT/profile_<shape>.txt."""
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        try:
            with profile(activities=acts) as prof:
                fn()
                self.timer.sync()
            key = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
            table = prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=70)
            Path(self.args.out, f"profile_{shape}.txt").write_text(table)
            print("\n".join(table.splitlines()[:25]), flush=True)
        except Exception:  # a profile is a nice-to-have: never lose the table for it
            traceback.print_exc()

    def build(self, shape: str, name: str, make):
        def fn():
            t0 = time.perf_counter()
            obj = make()
            self.timer.sync()
            return 1e3 * (time.perf_counter() - t0), 0, "build time (host clock)", obj
        return self.case(shape, name, "", fn)

    def decode(self, step, flops: float, nbytes: float):
        def fn():
            ms, _ = self.timer.median(step, reps=self.args.steps, warmup=3)
            return ms, flops, f"per step (median); {nbytes / ms / 1e6:.4g} GB/s weights + KV + states", None
        return fn

    def shape(self, shape: str) -> None:
        a, dev, reps = self.args, self.device, self.args.reps
        c = config(shape, a.tiny)
        model = self.build(shape, "build hypic", lambda: build_hypic(c, dev, self.dtype))
        if model is None:
            return
        n, elem = counts(model, c), torch.finfo(self.dtype).bits // 8
        T, B = a.tokens, 8
        ids = torch.randint(0, c["vocab_size"], (T,), generator=torch.Generator().manual_seed(1)).to(dev)
        ref = None
        if shape == "9b" and not a.no_hf:  # transformers first, freed before hypic's cases
            hf = self.build(shape, "build transformers", lambda: build_hf(c, model, dev, self.dtype))
            if hf is not None:
                def hf_prefill():
                    ms, out = self.timer.median(
                        lambda: hf(input_ids=ids[None], use_cache=False, logits_to_keep=1).logits, reps=reps)
                    return ms, prefill_flops(n, c, [T]), "logits_to_keep=1, use_cache=False", out[0, -1].float()

                ref = self.case(shape, "transformers prefill", f"1×{T}", hf_prefill)
                if a.accuracy_tokens:
                    self.case(shape, "bf16 accuracy vs hypic fp32", f"1×{a.accuracy_tokens}",
                              lambda: accuracy(model, hf, ids[:a.accuracy_tokens], dev))
                if not a.no_hf_decode:
                    self.case(shape, "transformers decode", f"b1 @{T}",
                              lambda: self.decode(hf_stepper(hf, ids), *decode_cost(n, c, 1, T, elem))())
            del hf
            self.free()

        def prefill(ids_list, check):
            def fn():
                ms, (logits, states) = self.timer.median(lambda: hypic_prefill(model, ids_list, dev), reps=reps)
                note = compare(logits[-1], ref) if check and ref is not None else "last-token logits"
                return ms, prefill_flops(n, c, [len(x) for x in ids_list]), note, (logits, states)
            return fn

        # A/B rows against the defaults (fla's fused norms; cuDNN attention for long causal prefills)
        os.environ["HYPIC_FUSED_NORMS"] = "0"
        self.case(shape, "hypic prefill, PyTorch norms", f"1×{T}", prefill([ids], True))
        del os.environ["HYPIC_FUSED_NORMS"]
        hattn.CUDNN_MIN_TOKENS = 1 << 40
        self.case(shape, "hypic prefill, flash attention (no cuDNN)", f"1×{T}", prefill([ids], True))
        hattn.CUDNN_MIN_TOKENS = int(os.environ.get("HYPIC_CUDNN_MIN_TOKENS", "8192"))
        if a.profile:
            self.profile(shape, lambda: hypic_prefill(model, [ids], dev))
        self.free()
        original = getattr(hctx, "attention", None)  # the name hypic.models.context calls, if it still does
        variants = [("", original)] + ([] if a.no_patch or original is None else [(" +4-D SDPA patch", sdpa_4d)])
        batch = [ids[i * (T // B):(i + 1) * (T // B)] for i in range(B)]
        for label, attn in variants:
            if attn is not None:
                hctx.attention = attn
            try:
                for prompts in ([ids], batch):
                    bs, L = len(prompts), len(prompts[0])
                    out = self.case(shape, f"hypic prefill{label}", f"{bs}×{L}", prefill(prompts, bs == 1))
                    if out is not None:  # decode on from that prefill's states, same attention code
                        step = hypic_stepper(model, out[1], out[0], dev)
                        del out
                        self.case(shape, f"hypic decode{label}", f"b{bs} @{L}",
                                  self.decode(step, *decode_cost(n, c, bs, L, elem)))
                        del step
                    self.free()
            finally:
                if original is not None:
                    hctx.attention = original


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tokens", type=int, default=None, help="prompt length (default 32768; 256 with --tiny)")
    p.add_argument("--shapes", default="9b,35b", help="comma list of: 9b, 35b")
    p.add_argument("--reps", type=int, default=3, help="timed prefills per case (after one warm-up)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per case (after 3 warm-up)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--no-hf-decode", action="store_true", help="skip transformers' decode")
    p.add_argument("--no-patch", action="store_true", help="skip the cases with the 4-D SDPA patch")
    p.add_argument("--profile", action="store_true", help="profile one prefill per shape into $OUT")
    p.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU in fp32 (a smoke test)")
    p.add_argument("--accuracy-tokens", type=int, default=4096,
                   help="prompt of the bf16-vs-fp32 accuracy check (0: skip)")
    a = p.parse_args()
    a.tokens = a.tokens or (256 if a.tiny else 32768)
    a.accuracy_tokens = min(a.accuracy_tokens, a.tokens)
    device = torch.device("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a.steps = min(a.steps, 4) if a.tiny else a.steps
    bench = Bench(a, device, dtype)
    with torch.no_grad():
        bench.matmul()
        for shape in a.shapes.split(","):
            bench.shape(shape.strip())
            bench.free()
    machine = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    tf_version = getattr(sys.modules.get("transformers"), "__version__", "not loaded")
    text = "\n".join([
        "## Whole models" + (" (--tiny: CPU smoke test, fp32)" if a.tiny else ""),
        "",
        f"Command: `python3 scripts/gpu_models.py {' '.join(sys.argv[1:])}` · machine: {machine} · "
        f"torch {torch.__version__} · transformers {tf_version} · {when}",
        "",
        "Random weights (bf16 on the GPU). ms: median (CUDA events). TFLOP/s: matmul + attention FLOPs over the time "
        "(GDN recurrence not counted; the script's docstring says what is); % of this run's matmul rate. "
        "`+4-D SDPA patch`: hypic with its attention() swapped for 4-D SDPA + enable_gqa (not in the tree).",
        "",
        "| shape | case | tokens | ms | TFLOP/s | % matmul | peak GiB | notes |",
        "|---|---|---|---|---|---|---|---|",
        *bench.rows,
    ])
    with open(os.path.join(a.out, "models.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
