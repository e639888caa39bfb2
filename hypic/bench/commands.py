"""The ``hypic bench`` commands: ``ttft``, ``scatter`` and ``trace``, each printing a table with the
command, the machine and the date, and appending it to ``--out`` (docs/benchmarks.md).

A bad option is a ``ValueError`` naming it, raised before the model is built (minutes on a GPU) and
printed by ``hypic.cli.main`` as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import math
import os

import torch

from hypic.bench.shapes import SHAPES
from hypic.cache.layout import HOST_DTYPES


def _bench_model(args: argparse.Namespace) -> tuple[object, str, str]:
    """The benchmark's model (a folder, or random weights of a real shape), its title, and the
    machine's name for the table's footer."""
    import platform

    from hypic.models.loader import load_model, resolve_device
    from hypic.models.random_init import random_model

    device = resolve_device(args.device)  # an unknown device, or CUDA missing: a ValueError, as for `LLM`
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype or
                                                                   ("bfloat16" if device.type == "cuda" else "float32")]
    q = None if args.quantization == "none" else args.quantization
    if args.model:
        loaded, title = load_model(args.model, device=device, dtype=dtype, quantization=q), args.model
    else:
        loaded = random_model(SHAPES[args.shape], device=device, dtype=dtype, quantization=q)
        title = f"{args.shape} (random weights)"
    if loaded.quantization is not None:
        title += f", weights {loaded.quantization}"
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    return loaded, f"{title}, {dtype}", machine


def _publish(table: str, machine: str, args: argparse.Namespace) -> None:
    """Print a benchmark's table with its command, machine and date, and append it to ``--out``."""
    import datetime

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = table + f"\n\nCommand: `hypic {' '.join(args.argv)}` · {machine} · torch {torch.__version__} · {when}\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)


def _at_least(args: argparse.Namespace, least: int, *options: str) -> None:
    """Each of ``options`` (``--docs``: ``args.docs``) at least ``least``, else a ValueError naming it."""
    for option in options:
        value = getattr(args, option[2:].replace("-", "_"))
        if value < least:
            raise ValueError(f"{option}: expected at least {least}, got {value}")


def _rag_options(args: argparse.Namespace) -> None:
    """The options ``ttft`` and ``scatter`` share: a prompt of no documents, or a p50 over no
    repetitions, failed only after the model was built and warmed (or printed a table of nothing)."""
    _at_least(args, 1, "--docs", "--doc-tokens", "--reps")
    _at_least(args, 0, "--seam")


def _fits(limit: int, tokens: int, what: str) -> None:
    """The benchmark's longest prompt within the model's context, checked before its token lists are
    drawn: ``--doc-tokens 99999999999`` filled the host's memory until the kernel killed the process."""
    if tokens > limit:
        raise ValueError(f"{what}: a prompt of {tokens} tokens; the model's context holds {limit}")


def bench_ttft(args: argparse.Namespace) -> int:
    from hypic.bench.ttft import RagShape, report, run
    from hypic.engine.engine import Engine

    _rag_options(args)
    _at_least(args, 1, "--head-tokens", "--query-tokens")
    if args.sync_report and not os.path.isdir(os.path.dirname(os.path.abspath(args.sync_report))):
        raise ValueError(f"--sync-report {args.sync_report}: its folder does not exist")  # found after the run
    loaded, title, machine = _bench_model(args)
    _fits(loaded.model.max_positions, args.head_tokens + args.docs * args.doc_tokens + args.query_tokens,
          "--head-tokens + --docs × --doc-tokens + --query-tokens")
    device = loaded.device  # type: ignore[attr-defined]
    shape = RagShape(args.docs, args.doc_tokens, args.head_tokens, args.query_tokens)
    engine = Engine(loaded, seam=args.seam)
    ab = args.ab and device.type == "cuda"
    res = run(engine, shape, reps=args.reps, ab=ab)
    _publish(report(res, shape, f"TTFT: {title}, seam {args.seam}"), machine, args)
    if args.sync_report and device.type == "cuda":
        from hypic.bench.syncs import format_sites, profile_request, step_sync_sites, sync_sites
        from hypic.bench.ttft import rag_prompts
        # the run's documents in an order it never used: every document hits, the prefix cache has only the head
        prompt = rag_prompts(shape, engine.model.vocab_size, args.reps + 3)[-1]
        sites = sync_sites(engine, prompt, ("hypic", "full", "prefix"))
        warm = profile_request(engine, prompt, "hypic")
        engine.store.clear()  # and once cold
        sites["hypic cold"] = sync_sites(engine, prompt, ("hypic",))["hypic"]
        sites.update(step_sync_sites(engine, rag_prompts(shape, engine.model.vocab_size, 4)))
        with open(args.sync_report, "w") as f:
            f.write(format_sites(sites) + "\n\n" + warm + "\n")
    return 0


def bench_scatter(args: argparse.Namespace) -> int:
    from hypic.bench.scatter import HEAD_TOKENS, KINDS, QUERY_TOKENS, report, run
    from hypic.engine.engine import Engine

    _rag_options(args)
    _at_least(args, 1, "--workers")  # the bench compares scattering with one device
    kinds = args.kinds.split(",")
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"--kinds: expected a comma list of {', '.join(KINDS)}, got {args.kinds!r}")
    loaded, title, machine = _bench_model(args)
    # a skewed document is up to 4 × --doc-tokens long (SKEWED_LENGTHS), each prompt has a head and a query
    longest = max(8, (4 if "skewed" in kinds else 1) * args.doc_tokens)
    _fits(loaded.model.max_positions, HEAD_TOKENS + args.docs * longest + QUERY_TOKENS,
          "--docs × --doc-tokens" + (" (skewed: documents up to 4 × --doc-tokens)" if "skewed" in kinds else ""))
    engine = Engine(loaded, seam=args.seam, cold_workers=args.workers)
    try:
        results = [run(engine, kind, args.docs, args.doc_tokens, args.reps) for kind in kinds]
    finally:
        engine.close()
    title = f"Cold TTFT, documents scattered over {1 + args.workers} devices: {title}, seam {args.seam}"
    _publish(report(results, title), f"{1 + args.workers} × {machine}", args)
    return 0


def _pair(text: str, name: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--{name}: expected lo,hi (two integers), got {text!r}") from None
    return lo, hi


def _rates(text: str) -> list[float]:
    """``--rates``: the grid, each a finite positive QPS (``nan`` ran a sweep and printed its table)."""
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        rates = []
    if not rates or not all(0 < r < math.inf for r in rates):
        raise ValueError(f"--rates: expected a comma list of finite positive numbers (QPS), got {text!r}")
    return rates


def bench_trace(args: argparse.Namespace) -> int:
    from hypic.bench.trace import TraceLoad, make_trace, report, run
    from hypic.bench.trace_targets import EngineTarget, HttpTarget
    from hypic.engine.engine import Engine
    from hypic.engine.modes import MODES
    from hypic.llm import bundled_model_path

    modes = [m.strip() for m in args.modes.split(",")]
    if not all(m in MODES for m in modes):  # the library's check names its field (mode:), not the flag
        raise ValueError(f"--modes: expected a comma list of {', '.join(MODES)}, got {args.modes!r}")
    rates = _rates(args.rates)
    load = TraceLoad(requests=args.requests, warm=args.warm, pool=args.pool, zipf=args.zipf,
                     num_docs=_pair(args.num_docs, "num-docs"), doc_tokens=_pair(args.doc_tokens, "doc-tokens"),
                     max_tokens=args.max_tokens, slo_s=args.slo_ms / 1000, max_running=args.max_running,
                     max_prefill_tokens=args.max_prefill_tokens, seed=args.seed)
    trace = make_trace(load, sorted(rates))
    if args.url:  # a running server: its model, its device, its limits
        target = HttpTarget(args.url, trace, api_key=args.api_key or os.environ.get("HYPIC_API_KEY"),
                            answers=not args.no_answers)
        probes = run(target, trace, load, modes, rates)
        title = f"A RAG trace served in real time: {target.model} at {args.url}"
        _publish(report(probes, load, rates, title, url=args.url), "the server's machine", args)
        return 0
    _at_least(args, 0, "--seam", "--workers")
    if args.cache_gib is not None and not 0 <= args.cache_gib < math.inf:  # 0: nothing kept on the device
        raise ValueError(f"--cache-gib: expected a finite number ≥ 0, got {args.cache_gib}")
    loaded, title, machine = _bench_model(args)
    own = loaded.tokenizer  # type: ignore[attr-defined]  # None for random weights
    if own is None:  # … then the bundled tokenizer gives the documents their lengths
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))
    else:
        tokenizer = own
    engine = Engine(loaded, seam=args.seam, cold_workers=args.workers,
                    cache_device_bytes="auto" if args.cache_gib is None else int(args.cache_gib * 2**30),
                    cache_host_dtype=args.cache_host_dtype)
    budget = engine.store.budgets["device"]
    local = EngineTarget(engine, trace, tokenizer, answers_from=own, max_running=load.max_running,
                         max_queue=load.requests + 1, max_prefill_tokens=load.max_prefill_tokens,
                         profile=args.profile)
    try:
        probes = run(local, trace, load, modes, rates)
    finally:
        engine.close()
    devices = "" if not args.workers else f", cold segments over {1 + args.workers} devices"
    table = report(probes, load, rates, f"A RAG trace served in real time: {title}, seam {args.seam}{devices}",
                   budget)
    if engine.device.type == "cuda":  # what the store's budget left for the model and the requests
        table += f"\n\nPeak device memory (allocated, over the run): {local.peak.bytes() / 2**30:.1f} GiB."
    _publish(table, machine, args)
    return 0


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p_bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = p_bench.add_subparsers(dest="bench", required=True)
    shared = argparse.ArgumentParser(add_help=False)  # what every model benchmark takes
    shared.add_argument("--model", help="a model folder (default: random weights of --shape)")
    shared.add_argument("--shape", default="qwen3.5-9b", choices=sorted(SHAPES))
    shared.add_argument("--device")
    shared.add_argument("--dtype", choices=["bfloat16", "float32"])
    shared.add_argument("--quantization", default="auto", choices=["auto", "fp8", "none"],
                        help="fp8: projections and experts held in 8 bits; none; auto: fp8 for an FP8 checkpoint on "
                             "a GPU")
    shared.add_argument("--seam", type=int, default=8)
    shared.add_argument("--out", help="append the table to this markdown file")
    rag = argparse.ArgumentParser(add_help=False)  # the fixed-shape RAG prompts of ttft and scatter
    rag.add_argument("--docs", type=int, default=32)
    rag.add_argument("--doc-tokens", type=int, default=1024)
    p_ttft = bench_sub.add_parser("ttft", parents=[shared, rag], help="TTFT across the mode ladder on RAG prompts")
    p_ttft.add_argument("--sync-report", help="CUDA: write where warm/full/prefix requests sync the host, to FILE")
    p_ttft.add_argument("--head-tokens", type=int, default=512)
    p_ttft.add_argument("--query-tokens", type=int, default=64)
    p_ttft.add_argument("--reps", type=int, default=10)
    p_ttft.add_argument("--ab", action="store_true",
                        help="CUDA: add warm rows with the recurrent short-run path and hypic's conv undone")
    p_ttft.set_defaults(func=bench_ttft)
    p_sc = bench_sub.add_parser("scatter", parents=[shared, rag],
                                help="cold TTFT with documents prefilled across devices")
    p_sc.add_argument("--workers", type=int, default=1, help="cold workers besides the engine's device")
    p_sc.add_argument("--kinds", default="uniform,skewed", help="prompt sets: uniform, skewed")
    p_sc.add_argument("--reps", type=int, default=5)
    p_sc.set_defaults(func=bench_scatter)
    p_tr = bench_sub.add_parser("trace", parents=[shared],
                                help="a RAG trace served in real time: TTFT under load, sustainable rate per mode")
    p_tr.add_argument("--modes", default="full,prefix,hypic", help="comma list of modes")
    p_tr.add_argument("--rates", default="1,2,4,8", help="comma list of arrival rates (QPS), the sweep's grid")
    p_tr.add_argument("--slo-ms", type=float, default=1000.0, help="the SLO on a rate's p90 TTFT")
    p_tr.add_argument("--requests", type=int, default=64, help="requests per rate")
    p_tr.add_argument("--warm", type=int, default=64, help="unmeasured warm-up requests per mode")
    p_tr.add_argument("--pool", type=int, default=256, help="documents in the trace's pool")
    p_tr.add_argument("--zipf", type=float, default=1.0, help="the pool's popularity exponent")
    p_tr.add_argument("--num-docs", default="4,32", help="documents per request: lo,hi")
    p_tr.add_argument("--doc-tokens", default="64,512", help="document length: lo,hi")
    p_tr.add_argument("--max-tokens", type=int, default=16, help="tokens decoded per request")
    p_tr.add_argument("--max-running", type=int, default=32, help="the serving loop's concurrent requests")
    p_tr.add_argument("--max-prefill-tokens", type=int,
                      help="tokens computed per prefill call; longer prompts' documents prefilled ahead in "
                      "slices (default: no limit)")
    p_tr.add_argument("--workers", type=int, default=0, help="cold workers besides the engine's device")
    p_tr.add_argument("--cache-gib", type=float, help="the segment store's device budget (default: auto, "
                                                          "hypic.cache.budgets)")
    p_tr.add_argument("--cache-host-dtype", default="auto", choices=[*HOST_DTYPES, "auto"],
                      help="the host tier's summaries (hypic.cache.store; default auto: bfloat16 on a GPU, "
                           "float32 on the CPU)")
    p_tr.add_argument("--seed", type=int, default=0)
    p_tr.add_argument("--profile", metavar="FILE", help="profile the serving loop's thread (cProfile): statistics "
                      "saved to FILE.<mode>, the top 30 functions by own time printed (in process only)")
    p_tr.add_argument("--url", help="send the requests to this running `hypic serve` instead (e.g. "
                                    "http://127.0.0.1:8000); the model options are then unused")
    p_tr.add_argument("--api-key", help="the server's key (default: $HYPIC_API_KEY)")
    p_tr.add_argument("--no-answers", action="store_true", help="over HTTP: the served model is untrained, "
                                                                 "leave out exact match")
    p_tr.set_defaults(func=bench_trace)
