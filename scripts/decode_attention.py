"""Decode attention candidates timed side by side on the GPU: one query token per sequence over a
key/value arena padded to ``cap`` rows, each sequence with its own length (the stacked decode
step's attention, ``hypic.models.decode_batch``). On the H200 the current one — SDPA's
memory-efficient kernel with a boolean mask — took 4.2 of a 16-sequence step's 11.8 ms of device
time (525 µs a layer, ≈ 4× what reading the keys and values costs), so this asks which stock
kernel reads the arena fastest. Each candidate is checked against an fp32 reference; one that
fails to run prints why. The 9B shape's attention heads: 16 query heads, 4 key heads, dim 256.

    python3 scripts/decode_attention.py [--slots 1,16,32] [--caps 4096,16384]
    python3 scripts/decode_attention.py --device cpu --slots 2 --caps 256   # a smoke run
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HKV, D = 16, 4, 256


def timed(fn, reps: int = 50) -> float:
    """Median µs per call (CUDA events; after warm-up calls)."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():  # a CPU smoke run of the script: host clock
        import time
        t = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(1e3 * a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", default="1,16,32")
    ap.add_argument("--caps", default="4096,16384")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (fp32; only the portable candidates run)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"torch {torch.__version__}; {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}")
    print("| slots | cap | candidate | µs | max error vs fp32 | note |")
    print("|---|---|---|---|---|---|")
    for n in (int(x) for x in args.slots.split(",")):
        for cap in (int(x) for x in args.caps.split(",")):
            # token-major arena [slots, cap, Hkv, D] (a flat [slots·cap, Hkv, D] view for varlen
            # kernels); the head-major view [slots, Hkv, cap, D] is what the current step reads
            k_tm = torch.randn(n, cap, HKV, D, device=dev, dtype=dt, generator=gen)
            v_tm = torch.randn(n, cap, HKV, D, device=dev, dtype=dt, generator=gen)
            k_hm, v_hm = k_tm.transpose(1, 2).contiguous(), v_tm.transpose(1, 2).contiguous()
            lengths = torch.randint(cap // 4, cap, (n,), device=dev, generator=gen)  # keys visible
            q = torch.randn(n, HQ, D, device=dev, dtype=dt, generator=gen)
            scale = D ** -0.5
            visible = torch.arange(cap, device=dev)[None, :] < lengths[:, None]  # [n, cap]
            # reference: fp32, GQA by repeating the key heads
            kf = k_hm.float().repeat_interleave(HQ // HKV, 1)
            vf = v_hm.float().repeat_interleave(HQ // HKV, 1)
            s = torch.einsum("nhd,nhcd->nhc", q.float(), kf) * scale
            s = s.masked_fill(~visible[:, None, :], float("-inf"))
            ref = torch.einsum("nhc,nhcd->nhd", s.softmax(-1), vf)
            del kf, vf, s
            qg = q.view(n, HKV, HQ // HKV, D)
            mask = visible.view(n, 1, 1, cap)

            def sdpa(backend, kk=k_hm, vv=v_hm):
                def f():
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(qg, kk, vv, attn_mask=mask, scale=scale).reshape(n, HQ, D)
                return f

            def matmul():
                sc = torch.matmul(qg, k_hm.transpose(-1, -2)).float() * scale  # [n, Hkv, g, cap]
                sc = sc.masked_fill(~mask, float("-inf"))
                return torch.matmul(sc.softmax(-1).to(dt), v_hm).reshape(n, HQ, D)

            cu_q = torch.arange(n + 1, device=dev, dtype=torch.int32)
            cu_k = (torch.arange(n + 1, device=dev, dtype=torch.int32) * cap).contiguous()
            used = lengths.to(torch.int32)
            kflat, vflat = k_tm.view(n * cap, HKV, D), v_tm.view(n * cap, HKV, D)

            def flash(splits=None):
                def f():
                    kw = {} if splits is None else {"num_splits": splits}
                    out = torch.ops.aten._flash_attention_forward(q, kflat, vflat, cu_q, cu_k, 1, cap, 0.0, False,
                                                                  False, scale=scale, seqused_k=used, **kw)
                    return out[0]
                return f

            cands = [("sdpa efficient, bool mask (now)", sdpa(SDPBackend.EFFICIENT_ATTENTION), ""),
                     ("sdpa efficient, token-major view", sdpa(SDPBackend.EFFICIENT_ATTENTION, k_tm.transpose(1, 2),
                                                               v_tm.transpose(1, 2)), "strided keys"),
                     ("sdpa math, bool mask", sdpa(SDPBackend.MATH), ""),
                     ("matmul, fp32 softmax", matmul, "scores rounded to bf16"),
                     ("flash varlen + seqused_k", flash(), "token-major arena"),
                     ("flash varlen + seqused_k, 8 splits", flash(8), "token-major arena")]
            for name, fn, note in cands:
                try:
                    err = float((fn().float() - ref).abs().max())
                    us = timed(fn)
                    print(f"| {n} | {cap} | {name} | {us:.1f} | {err:.2e} | {note} |", flush=True)
                except Exception as e:  # noqa: BLE001 — a candidate that cannot run says why, the others go on
                    print(f"| {n} | {cap} | {name} | – | – | {type(e).__name__}: {str(e)[:120]} |", flush=True)
            # what reading the keys and values once costs at the H200's ≈ 4.8 TB/s
            print(f"| {n} | {cap} | (keys + values read once) | {2 * k_tm.numel() * k_tm.element_size() / 4.8e6:.1f} | – | bound |")


if __name__ == "__main__":
    main()
