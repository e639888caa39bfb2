"""GPU check of hypic.ops on the H200 (never in CI): the fla path against an fp64 reference,
composed states against the kernel's own full run, and the cost of summary extraction.

Run through scripts/gpu_check.sh, which installs the fla wheels first. Prints a markdown table
last and writes it (with the command, machine and date) to $OUT/ops.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hypic.ops import recurrence  # noqa: E402
from hypic.ops.linear import linear_attention  # noqa: E402


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def gdn_inputs(total: int, H: int, HV: int, K: int, V: int, dtype: torch.dtype, seed: int) -> dict:
    """Qwen3.5-like GDN inputs: l2-normalised q/k, sigmoid β, decays from the layer's gate."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = F.normalize(torch.randn(total, H, K, device=dev, generator=gen), dim=-1)
    k = F.normalize(torch.randn(total, H, K, device=dev, generator=gen), dim=-1)
    v = torch.randn(total, HV, V, device=dev, generator=gen)
    a_log = torch.empty(HV, device=dev).uniform_(0, 2.77, generator=gen)  # A = exp(A_log) ∈ [1, 16]
    dt = torch.empty(total, HV, device=dev).uniform_(-6, -1, generator=gen)
    g = -a_log.exp() * F.softplus(dt)
    beta = torch.sigmoid(torch.randn(total, HV, device=dev, generator=gen))
    return {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype), "g": g.to(dtype), "beta": beta.to(dtype)}


_T0 = time.perf_counter()


def progress(line: str) -> None:
    """Printed at once with the time since start, so a run cut short by its time limit shows how far it got."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {line}", flush=True)


def emit(table: list[str], line: str) -> None:
    table.append(line)
    progress(line)


def bench(fn, reps: int = 50) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=reps, return_mode="median")


def check_families(rows: list[str]) -> None:
    """fla vs fp64 reference, varlen with GVA, every GPU family, with summaries."""
    lens = [1, 63, 64, 200, 1000]
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0)
    T, H, HV, K, V = sum(lens), 4, 8, 128, 128
    base = gdn_inputs(T, H, HV, K, V, torch.float64, seed=1)
    gk = -torch.rand(T, HV, K, device="cuda", dtype=torch.float64) * 0.2
    s0 = torch.randn(len(lens), HV, K, V, device="cuda", dtype=torch.float64)
    for fam in ("gdn", "kda", "scalar"):
        kw = {"g": gk if fam == "kda" else base["g"]}
        if fam != "scalar":
            kw["beta"] = base["beta"]
        ref = linear_attention(fam, base["q"], base["k"], base["v"], cu_seqlens=cu, initial_state=s0,
                               output_summary=True, backend="torch", **kw)
        # one sequence also against the token loop, to tie the fp64 chunk reference to `run`
        sl = slice(int(cu[3]), int(cu[4]))
        loop = recurrence.run(fam, base["q"][sl], base["k"][sl], base["v"][sl], initial_state=s0[3],
                              **{n: x[sl] for n, x in kw.items()})
        tie = rel(ref.final_state[3], loop.final_state)
        bf = {n: x.to(torch.bfloat16) for n, x in kw.items()}
        out = linear_attention(fam, base["q"].bfloat16(), base["k"].bfloat16(), base["v"].bfloat16(), cu_seqlens=cu,
                               initial_state=s0.float(), output_summary=True, backend="fla", **bf)
        t_err = rel(out.summary.transition, ref.summary.transition) if fam != "scalar" else 0.0
        emit(rows, f"| {fam} varlen {lens} GVA {H}/{HV} | o {rel(out.o, ref.o):.1e} | final {rel(out.final_state, ref.final_state):.1e} "
                    f"| S {rel(out.summary.state, ref.summary.state):.1e} | T {t_err:.1e} | chunk-vs-loop fp64 {tie:.1e} |")


def check_composition(rows: list[str], timings: list[str], errors: bool) -> None:
    """Qwen3.5 GDN dims, 32k tokens: composed state vs the kernel's own full run; summary cost."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from hypic.ops import linear_fla

    total, H, HV, K, V = 32768, 16, 32, 128, 128
    x64 = gdn_inputs(total, H, HV, K, V, torch.float64, seed=2)
    s0 = torch.randn(1, HV, K, V, device="cuda", dtype=torch.float64) * 0.1
    xb = {n: t.to(torch.bfloat16) for n, t in x64.items()}
    if errors:
        ref = linear_attention("gdn", x64["q"], x64["k"], x64["v"], g=x64["g"], beta=x64["beta"], initial_state=s0,
                               backend="torch").final_state[0]
        full = linear_attention("gdn", xb["q"], xb["k"], xb["v"], g=xb["g"], beta=xb["beta"],
                                initial_state=s0.float(), backend="fla").final_state[0]
        full_err = rel(full, ref)
        progress("gdn 32k fp64 reference and full fla run done")
    for nseg in (1, 8, 32, 64):
        seg = total // nseg
        cu_cpu = torch.arange(0, total + 1, seg)
        cu = cu_cpu.cuda()
        if errors:
            out = linear_attention("gdn", xb["q"], xb["k"], xb["v"], g=xb["g"], beta=xb["beta"], cu_seqlens=cu_cpu,
                                   output_summary=True, backend="fla")
            state = s0[0].float()
            for i in range(nseg):
                summary = recurrence.Summary(out.summary.transition[i], out.summary.state[i])
                state = recurrence.apply("gdn", summary, state)
            comp_err = rel(state, ref)
            emit(rows, f"| gdn 32k as {nseg}×{seg} | full-run err {full_err:.2e} | composed err {comp_err:.2e} "
                        f"| ratio {comp_err / full_err:.2f} | | |")
        h0 = torch.zeros(nseg, HV, K, V, device="cuda")
        args = (xb["q"][None], xb["k"][None], xb["v"][None], xb["g"][None].float(), xb["beta"][None])

        def plain():
            return chunk_gated_delta_rule(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu)

        def hypic_plain():
            return linear_attention("gdn", xb["q"], xb["k"], xb["v"], g=xb["g"], beta=xb["beta"], cu_seqlens=cu_cpu,
                                    initial_state=h0, backend="fla")

        def hypic_summary():
            return linear_attention("gdn", xb["q"], xb["k"], xb["v"], g=xb["g"], beta=xb["beta"], cu_seqlens=cu_cpu,
                                    initial_state=h0, output_summary=True, backend="fla")

        vz = torch.cat([xb["v"], xb["v"].new_zeros(total, HV, K)], -1)[None]
        hz = torch.cat([h0, torch.eye(K, device="cuda").expand(nseg, HV, K, K)], -1).contiguous()

        def one_call():
            return chunk_gated_delta_rule(args[0], args[1], vz, args[3], args[4], initial_state=hz,
                                          output_final_state=True, cu_seqlens=cu)

        t_plain, t_hp, t_one = bench(plain), bench(hypic_plain), bench(one_call)
        linear_fla.GDN_T_SCHEDULE = "serial"
        t_serial = bench(hypic_summary)
        linear_fla.GDN_T_SCHEDULE = "stream"
        t_sum = bench(hypic_summary)

        def pct(t: float) -> str:
            return f"{t:.3f} ({100 * (t / t_plain - 1):+.0f}%)"

        emit(timings, f"| {nseg}×{seg} | {t_plain:.3f} | {t_hp:.3f} | {pct(t_sum)} | {pct(t_serial)} | {pct(t_one)} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sections", default="families,composition",
                        help="comma list of: families, composition (errors), timing")
    args = parser.parse_args()
    sections = args.sections.split(",")
    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list[str] = []
    timings: list[str] = []
    if "families" in sections:
        check_families(rows)
    if "composition" in sections or "timing" in sections:
        check_composition(rows, timings, errors="composition" in sections)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([
        "## hypic.ops on the GPU",
        "",
        f"Command: `bash scripts/gpu_check.sh --sections {args.sections}` · machine: {torch.cuda.get_device_name()} · torch {torch.__version__} · {when}",
        "",
        "Errors are ‖x − ref‖/‖ref‖ against the fp64 chunked torch kernel (itself tied to the fp64 token loop); fla inputs bf16.",
        "",
        "| case | | | | | |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "GDN forward at Qwen3.5 dims (H=16, HV=32, K=V=128, bf16), 32k tokens, median ms (triton do_bench):",
        "",
        "| split | fla chunk_gated_delta_rule | hypic, no summary | hypic with (T, S): T pass on a side stream "
        "| T pass after (serial) | one-call [v\\|0], h0=[S\\|I] (public fla API) |",
        "|---|---|---|---|---|---|",
        *timings,
    ])
    with open(os.path.join(args.out, "ops.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
