"""Command line: ``hypic demo`` (the main job), ``hypic serve`` (the OpenAI-compatible server),
``hypic run-batch`` (a file of requests answered as the server would), ``hypic generate``,
``hypic bench ttft | scatter | trace``, ``hypic eval quality | deviation``.

``hypic demo --self-check`` is the algebra's check without a model: for every linear-attention
family it splits a random span in two, composes the halves' cached summaries and prints how far the
result is from running the whole span, next to the naive sum that drops ``T``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hypic.bench.commands import add_bench_parser
from hypic.cache.layout import HOST_DTYPES

if TYPE_CHECKING:
    from hypic.llm import LLM
    from hypic.server.settings import ServerSettings
from hypic.engine.collector import freeze_long_lived
from hypic.engine.modes import MODES
from hypic.engine.request import check_seed
from hypic.ops import recurrence as R
from hypic.ops.family import FAMILIES
from hypic.ops.linear import linear_attention
from hypic.ops.samples import family_inputs


def demo(args: argparse.Namespace) -> int:
    """The RAG session on a model (the bundled one by default); the algebra self-check without one."""
    from hypic.demo import print_session, rag_session
    from hypic.llm import LLM, bundled_model_path

    check_seed(args.seed, "--seed", room=len(FAMILIES))  # the self-check seeds seed + i per family
    if args.self_check:
        return algebra_check(args)
    if args.model or bundled_model_path().is_dir():
        llm = LLM(args.model, device=args.device)
        print(f"hypic demo: {llm.loaded.path} on {llm.loaded.device}")
        print_session(rag_session(llm, questions=args.questions, seed=args.seed))
        return 0
    print("no bundled model in this installation: running the algebra self-check instead")
    return algebra_check(args)


MAX_CHECK_LENGTH = 10_000  # the token loop over 2 × 10 000 tokens per family: a minute on a CPU


def algebra_check(args: argparse.Namespace) -> int:
    """0 when every composition and the chunk kernel are within 1e-4 of the token loop, else 1."""
    n = args.length
    if n < 1:  # an empty span passes trivially
        raise ValueError(f"--length: expected at least 1 token per span, got {n}")
    if n > MAX_CHECK_LENGTH:  # 10**9 asked the allocator for 2 TB after the table's header was printed
        raise ValueError(f"--length: expected at most {MAX_CHECK_LENGTH} tokens per span, got {n}")
    gen = torch.Generator().manual_seed(args.seed)
    print(f"hypic algebra self-check: two spans of {n} tokens, 4 heads, K = V = 32")
    print(f"{'family':<10}{'compose fp64':>14}{'compose fp32':>14}{'chunk kernel':>14}{'naive S1+S2':>14}")
    errors: list[float] = []
    for i, family in enumerate(FAMILIES):
        x = family_inputs(family, 2 * n, heads=4, value_heads=4, key_dim=32, value_dim=32, seed=args.seed + i,
                          decay=0.1)
        gates = {k: t for k, t in x.items() if k in ("g", "beta", "a", "b")}
        s0 = torch.randn(4, 32, 32, generator=gen, dtype=torch.float64)
        ref = R.run(family, x["q"], x["k"], x["v"], initial_state=s0, **gates).final_state
        row = []
        for dtype in (torch.float64, torch.float32):
            halves = [R.summarize(family, x["k"][s].to(dtype), x["v"][s].to(dtype),
                                  **{k: t[s].to(dtype) for k, t in gates.items()})
                      for s in (slice(0, n), slice(n, 2 * n))]
            out = R.apply(family, R.compose(family, *halves), s0.to(dtype))
            row.append(((out.double() - ref).norm() / ref.norm()).item())
        x32 = {k: t.float() for k, t in x.items()}
        chunk = linear_attention(family, x32["q"], x32["k"], x32["v"], initial_state=s0.float()[None],
                                 **{k: x32[k] for k in gates}).final_state[0]
        row.append(((chunk.double() - ref).norm() / ref.norm()).item())
        halves = [R.summarize(family, x["k"][s], x["v"][s], **{k: t[s] for k, t in gates.items()})
                  for s in (slice(0, n), slice(n, 2 * n))]
        whole = R.summarize(family, x["k"], x["v"], **gates).state
        naive = ((halves[0].state + halves[1].state - whole).norm() / whole.norm()).item()
        errors += row
        print(f"{family:<10}" + "".join(f"{e:>14.1e}" for e in (*row, naive)))
    print("relative error of the final state vs the fp64 token loop; naive = summing states without T")
    # each error checked on its own: max() drops a NaN (nan > x is False), and NaN states are a failure
    return 0 if all(math.isfinite(e) and e < 1e-4 for e in errors) else 1


def eval_quality(args: argparse.Namespace) -> int:
    import datetime
    import json
    from pathlib import Path

    from hypic.eval.quality import evaluate
    from hypic.eval.report import docs_table, plot, relation_table, table
    from hypic.llm import bundled_model_path
    from hypic.models.loader import load_model

    if args.out:
        _check_report_out(args.out, sides=(".png", ".json"))
    n = args.n if args.n is not None else (4 if args.quick else 200)
    if n < 1:
        raise ValueError(f"--n: expected at least 1 example per family, got {n}")
    labels = _labels(args.labels)  # checked before the model loads
    path = args.model or str(bundled_model_path())
    loaded = load_model(path, device=args.device or "cpu", dtype=args.dtype,
                        quantization=_quantization(args.quantization))
    shown = os.path.relpath(path)
    shown = path if shown.startswith("..") else shown  # inside the checkout: no machine-specific path
    difficulty = args.difficulty if args.difficulty is not None else (0.3 if args.quick else 1.0)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    def summary(results) -> dict:
        return {"scores": {k: round(r.average, 3) for k, r in results.items()},
                "families": {k: r.family_scores for k, r in results.items()},
                "em": {k: r.family_em for k, r in results.items()},
                "relation_em": {k: r.relation_em for k, r in results.items()},
                "by_documents": {k: r.docs_scores for k, r in results.items()},
                "kl": {k: r.kl for k, r in results.items()}, "top1": {k: r.top1 for k, r in results.items()},
                "examples_per_family": n, "difficulty": difficulty}

    def report(results) -> None:  # rewritten after every label, so a cut-off run keeps what it finished
        out = Path(args.out)
        plot(results, out.with_suffix(".png"))
        out.with_suffix(".json").write_text(json.dumps(summary(results)) + "\n")
        out.write_text(f"{REPORT_MARK}\n# Quality across the mode ladder\n\nCommand: `hypic eval quality "
                       f"{' '.join(args.argv[2:])}` · "
                       f"model {shown} · {n} examples per family, difficulty {difficulty} · {when}\n\n"
                       f"Scores 0–100: F1 for QA, ROUGE-L for summaries; KL and top-1 compare the first token "
                       f"with `full`.\n\n{table(results)}\n\n![score vs seam]({out.with_suffix('.png').name})\n"
                       f"\nThe family average by the number of documents in the prompt (Δ vs `full` in the same "
                       f"prompts):\n\n{docs_table(results)}\n"
                       + (f"\nExact match per answered relation under `full` (a two-hop question counts under "
                          f"its second hop):\n\n{relation_table(results['full'])}\n" if "full" in results else ""))

    results = evaluate(loaded, n=n, difficulty=difficulty, labels=labels, batch=args.batch,
                       on_label=report if args.out else None)
    if args.json:
        print(json.dumps(summary(results)))
    else:
        print(table(results))
    return 0


def eval_deviation(args: argparse.Namespace) -> int:
    import datetime
    import json
    from dataclasses import asdict
    from pathlib import Path

    from hypic.eval.deviation import measure, tables
    from hypic.llm import bundled_model_path
    from hypic.models.loader import load_model

    if args.out:
        _check_report_out(args.out)
    labels = _labels(args.labels)  # checked before the model loads
    path = args.model or str(bundled_model_path())
    loaded = load_model(path, device=args.device or "cpu", dtype=args.dtype)
    results = measure(loaded, n=args.n, difficulty=args.difficulty, labels=labels, batch=args.batch)
    text = tables(results, loaded.model.kinds.kinds)
    if args.out:
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        Path(args.out).write_text(f"{REPORT_MARK}\n# Deviation from `full`, layer by layer\n\nCommand: `hypic eval "
                                  f"deviation {' '.join(args.argv[2:])}` · {args.n} examples per family, difficulty "
                                  f"{args.difficulty} · {when}\n\n{text}\n")
    if args.json:
        print(json.dumps({"deviation": {k: asdict(r) for k, r in results.items()},
                          "kinds": list(loaded.model.kinds.kinds), "examples_per_family": args.n,
                          "difficulty": args.difficulty}))
    else:
        print(text)
    return 0


REPORT_MARK = "<!-- written by hypic eval: each run rewrites this file -->"


def _check_report_out(out: str, sides: tuple[str, ...] = ()) -> None:
    """An eval report's ``--out`` (ValueError, before the model loads): a ``.md`` path whose file, if
    any, an earlier report wrote, and beside it no ``sides`` file (plot, JSON) of anything else. The
    report rewrites its files whole after every label: ``--out docs/quality.md`` once replaced the
    hand-written document (and its JSON record) after the first label of a mistyped run."""
    path = Path(out)
    if path.is_dir() or (sides and path.suffix.lower() != ".md"):  # the sides replace other suffixes
        raise ValueError(f"--out {out}: expected a .md file path (the report; its plot and JSON go beside it)")
    ours = path.is_file() and path.read_text(errors="replace").startswith(REPORT_MARK)
    for p in (path, *(path.with_suffix(x) for x in sides)):
        if p.exists() and not ours:
            raise ValueError(f"--out {out}: {p} exists and {path} does not begin with the line hypic eval "
                             f"writes first ({REPORT_MARK}); choose another path or remove it")


def flagged(error: ValueError, args: argparse.Namespace) -> str:
    """A library check's ``name: why`` as the option the user typed: ``--max-tokens: why`` for
    SamplingParams' ``max_tokens: why`` (``or None`` is no value a command line can give)."""
    name, sep, why = str(error).partition(": ")
    if sep and name.isidentifier() and name in vars(args) and name not in ("prompt", "func", "command", "argv"):
        return f"--{name.replace('_', '-')}: {why.replace(' or None', '')}"
    return str(error)


def _labels(text: str | None) -> list[str] | None:
    """``--labels``: None (all) when left out; ``""`` ran every label (hours on the bundled model)."""
    if text is None:
        return None
    labels = [label.strip() for label in text.split(",")]
    if not all(labels):
        raise ValueError(f"--labels: expected a comma list of mode labels, got {text!r}")
    return labels


def unit_interval(text: str) -> float:
    """``--difficulty``: a number in [0, 1], refused before the model loads (after it, once)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:  # nan too
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def parse_bytes(text: str) -> int:
    """``"4GiB"``, ``"512MB"``, ``"1000000"`` → bytes (binary and decimal suffixes)."""
    units = {"": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
             "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number):].lower()
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 4GiB, got {text!r}") from None
    if unit == "b":  # 512B
        unit = ""
    if unit not in units or not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a byte count such as 4GiB, got {text!r}")
    return int(value * units[unit])


def parse_port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0–65535, got {text!r}")
    return port


def parse_budget(text: str) -> int | str | None:
    """A cache tier's budget: a byte count (``parse_bytes``), ``auto`` or ``none`` (unbounded)."""
    word = text.strip().lower()
    if word == "auto":
        return "auto"
    if word in ("none", "unbounded"):
        return None
    return parse_bytes(text)


def _quantization(value: str) -> str | None:
    """--quantization's value: "none" keeps every weight in --dtype (the library's None)."""
    return None if value == "none" else value


SETTING_FLAGS = {"model_name": "--served-model-name", "request_timeout_s": "--request-timeout",
                 "shutdown_timeout_s": "--shutdown-timeout"}  # the rest: the setting's name as a flag


def _served(args: argparse.Namespace, command: str, api_key: str | None) -> tuple[LLM, ServerSettings]:
    """The LLM and the server settings ``serve`` and ``run-batch`` build from the same options, the
    saved cache loaded (a warm restart)."""
    from hypic.llm import LLM
    from hypic.server import ServerSettings

    # everything that can be checked without the model is, first: loading it (and starting cold
    # workers) takes minutes on a GPU before a typo in a limit or an unusable --cache-dir would show
    if args.served_model_name is not None and not args.served_model_name.strip():  # "" served the folder's name
        raise ValueError("--served-model-name: empty (leave it out to serve the folder's name)")
    try:
        settings = ServerSettings(
            model_name=args.served_model_name or _served_name(args.model),
            model_aliases=_aliases(args.model, args.served_model_name),
            api_key=api_key, max_segments=args.max_segments,
            max_prompt_tokens=args.max_prompt_tokens, max_completion_tokens=args.max_completion_tokens,
            max_concurrent=args.max_concurrent, max_queue=args.max_queue, max_choices=args.max_choices,
            max_prompts=args.max_prompts, request_timeout_s=args.request_timeout,
            shutdown_timeout_s=args.shutdown_timeout, shutdown_drain=args.shutdown_drain,
            scheduling_policy=args.scheduling_policy,
            max_prefill_tokens=args.max_prefill_tokens,
            cache_dir=args.cache_dir, reasoning_parser=args.reasoning_parser,
            max_stored_responses=args.max_stored_responses)
    except ValueError as e:  # named by the flag the user typed, not the setting behind it
        name, _, why = str(e).partition(": ")
        if not name.isidentifier():
            raise
        raise ValueError(f"{SETTING_FLAGS.get(name, '--' + name.replace('_', '-'))}: "
                         f"{why.replace(' or None', '')}") from None
    if args.max_prefill_tokens is not None and args.cold == "in_context":
        print(f"hypic {command}: --max-prefill-tokens bounds calls but prefills no documents ahead with --cold "
              "in_context (their entries depend on the prompt)", file=sys.stderr, flush=True)
    if args.cache_dir:
        _take_cache_dir(args.cache_dir)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, seam=args.seam, cold=args.cold,
              cache_device_bytes=args.cache_device_bytes, cache_host_bytes=args.cache_host_bytes,
              cold_workers=args.cold_workers, route=args.route, cache_host_dtype=args.cache_host_dtype,
              quantization=_quantization(args.quantization))
    warm = getattr(args, "warm_up", "off")  # serve's option; run-batch pays its kernels in its batch anyway
    if warm == "on" or (warm == "auto" and llm.engine.device.type == "cuda"):
        # before the saved cache is loaded: the warm-up's documents never push a saved entry down a tier
        _warm_up(llm, command, required=warm == "on")
    loaded = _load_saved_cache(llm, args.cache_dir)
    if loaded is not None:
        print(f"hypic {command}: {loaded} cached segments loaded from {args.cache_dir}", flush=True)
    # a process of its own: what it holds now (the model, the warm-up's vocabulary) out of the cycle
    # collector's full passes, and structured output's vocabulary too if it is built later
    llm.engine.freeze_collector = True
    freeze_long_lived()
    return llm, settings


def _warm_up(llm: LLM, command: str, *, required: bool) -> None:
    """The warm-up before serving, said as it runs. If it fails: with ``required`` (``--warm-up on``)
    a ValueError naming it (the command stops); else (``auto``) a warning, and the server starts
    without it — its first requests then compile their kernels."""
    where = "about a minute on a GPU" if llm.engine.device.type == "cuda" else "seconds on a CPU"
    print(f"hypic {command}: warming up: every request path once, compiling and tuning its kernels "
          f"({where}; --warm-up off skips it)", flush=True)
    try:
        done = llm.warm_up()
    except Exception as e:  # a model that cannot run says so here, not as a bare traceback
        if required:
            raise ValueError(f"--warm-up on: the warm-up failed: {type(e).__name__}: {e}") from e
        print(f"hypic {command}: the warm-up failed ({type(e).__name__}: {e}); serving without it: the first "
              "requests compile their kernels (--warm-up on makes this an error)", file=sys.stderr, flush=True)
    else:
        print(f"hypic {command}: warmed up in {done.seconds:.1f} s ({done.requests} synthetic calls, "
              f"{done.tokens} prompt tokens: kernels compiled and tuned before the first request)", flush=True)
        if done.out_of_memory or done.workers_lost:
            print(f"hypic {command}: the warm-up met faults the metrics count: {done.out_of_memory} calls out "
                  f"of device memory (retried), {done.workers_lost} cold workers lost", file=sys.stderr,
                  flush=True)


def _aliases(model: str | None, served_model_name: str | None) -> tuple[str, ...]:
    """Other names requests may give the model: without --served-model-name, the --model path as typed
    and resolved (vLLM serves the --model string; clients loading the tokenizer from it send it)."""
    if served_model_name or model is None:
        return ()
    return tuple(dict.fromkeys((model, str(Path(model).resolve()))))


def _served_name(model: str | None) -> str:
    """The name /v1/models shows: the model folder's, or ``hypic`` for the bundled model however it
    was named (``--model hypic/assets/default_model`` served it as "default_model", so requests for
    "hypic", the name the README gives, were 404s)."""
    from hypic.llm import bundled_model_path

    if model is None or Path(model).resolve() == bundled_model_path().resolve():
        return "hypic"
    return Path(model).resolve().name


def _take_cache_dir(folder: str) -> None:
    """``--cache-dir`` made if missing, able to take files now and held by no other process
    (ValueError): found at shutdown, an unusable folder lost everything the server had cached."""
    from hypic.cache import persist

    if not folder.strip():
        raise ValueError("--cache-dir: empty path (leave it out to run without a kept cache)")
    if Path(folder).exists() and not Path(folder).is_dir():  # mkdir said "File exists"
        raise ValueError(f"--cache-dir {folder}: not a folder")
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--cache-dir {folder}: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--cache-dir {folder}: not writable")
    persist.claim(folder)


def _close(llm: LLM, command: str, cache_dir: str | None) -> int:
    """Stop the cold workers and save the cache (with ``--cache-dir``); 1 if it could not be saved."""
    llm.close()
    if cache_dir:
        try:
            print(f"hypic {command}: {llm.save_cache(cache_dir)} cached segments saved to {cache_dir}", flush=True)
        except OSError as e:
            print(f"hypic {command}: the cache could not be saved to {cache_dir}: {e}", file=sys.stderr)
            return 1
    return 0


def run_batch(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from hypic.server import create_app
    from hypic.server.batch import run_batch as run

    try:
        # bytes, split at line ends only: a line that is not UTF-8 is that line's error, and a JSON
        # string's raw U+2028 (a line break to str.splitlines) stays inside its line
        for option, path in (("--input", args.input), ("--output", args.output)):
            if not path.strip():
                raise ValueError(f"{option}: empty path")
            if Path(path).is_dir():
                raise ValueError(f"{option} {path}: a folder; expected a JSONL file")
        if Path(args.output).exists() and Path(args.output).resolve() == Path(args.input).resolve():
            # the results were written over the requests
            raise ValueError(f"--output {args.output}: the --input file; the results would replace the requests")
        try:
            lines = Path(args.input).read_bytes().splitlines()
        except OSError as e:
            raise ValueError(f"--input {args.input}: {e.strerror or e}") from None
        try:
            Path(args.output).open("a").close()  # writable: found after the batch, it lost every result
        except OSError as e:
            raise ValueError(f"--output {args.output}: {e.strerror or e}") from None
        llm, settings = _served(args, "run-batch", None)  # in process: no key
    except (ValueError, OSError) as e:
        print(f"hypic run-batch: {flagged(e, args) if isinstance(e, ValueError) else e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        results, totals = asyncio.run(run(create_app(llm, settings), lines, settings.max_concurrent))
    finally:
        saved = _close(llm, "run-batch", args.cache_dir)
    Path(args.output).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
    statuses = ", ".join(f"{n} × {code}" for code, n in sorted(totals.by_status.items())) or "none"
    again = f", {totals.requeued} sent again for want of queue room" if totals.requeued else ""
    print(f"hypic run-batch: {totals.requests} requests ({statuses}{again}), {totals.not_requests} lines not requests; "
          f"{totals.prompt_tokens} prompt tokens, {totals.cached_tokens} from the cache; "
          f"{time.perf_counter() - t0:.1f} s → {args.output}", file=sys.stderr)
    return saved


def serve(args: argparse.Namespace) -> int:
    from hypic.server import create_app, serving
    from hypic.server.serving import HypicServer

    sockets: list = []
    try:
        if args.api_key is not None and not args.api_key.strip():  # "$UNSET_VAR": no key is not what was meant
            raise ValueError("--api-key: empty (leave it out to serve without a key)")
        sockets = _listen(args.host, args.port)
        llm, settings = _served(args, "serve", args.api_key or os.environ.get("HYPIC_API_KEY") or None)
        app = create_app(llm, settings)
    except ValueError as e:
        for s in sockets:
            s.close()
        print(f"hypic serve: {flagged(e, args)}", file=sys.stderr)
        return 2
    auth = "API key required" if settings.api_key else "no API key"
    port = sockets[0].getsockname()[1]  # --port 0: the one the system chose, which a client must be told
    loaded = llm.loaded
    held = f"{str(loaded.dtype).removeprefix('torch.')}" + (", weights in 8 bits" if loaded.quantization else "")
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters()) / 2**30
    print(f"hypic serve: {settings.model_name} on http://{args.host}:{port} ({llm.engine.device}, {held}, "
          f"{weights:.3g} GiB of weights, {auth})", flush=True)
    # uvicorn shuts down gracefully on SIGINT and SIGTERM (the app finishes or cancels in-flight
    # requests), then raises the signal again under the handler it found: SIGINT's is Python's
    # KeyboardInterrupt, SIGTERM's the default, which killed the process before the cache was saved
    # (SIGTERM is what systemd, docker stop and Kubernetes send). So SIGTERM interrupts like Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        HypicServer(serving.config(app, settings, host=args.host, port=port, log_level=args.log_level)).run(sockets)
    except KeyboardInterrupt:
        pass
    finally:
        # the shutdown a SIGTERM asks for is under way: one more (a supervisor repeating itself) asks the
        # same, as uvicorn reads it, and must not cut the cache's save short (seconds for a large cache)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for s in sockets:  # uvicorn closes those it listened on; a run cut short before that leaves them
            s.close()
        saved = _close(llm, "serve", args.cache_dir)  # the cold workers, if any, and the cache
    return saved


def _listen(host: str, port: int) -> list:
    """Sockets bound to ``host:port`` now, as uvicorn would bind them (SO_REUSEADDR, every address the
    host resolves to), for uvicorn to listen on once the model is ready; ValueError naming --host or
    --port when that cannot be. Found by uvicorn, a port in use or a mistyped host ended the command
    with exit status 3 after the model had loaded and warmed up (minutes on a GPU). Binding here also
    tells ``--port 0``'s chosen port before serving (announced as 0 before): such a port is bound on
    the first address only, since each address would get a port of its own."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"--host {host}: {getattr(e, 'strerror', None) or e}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in infos[:1] if port == 0 else infos:
            s = socket.socket(family, kind, proto)
            sockets.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio's create_server does
            try:
                s.bind(address)
            except OSError as e:  # in use or privileged: the port's fault; not this machine's address: the host's
                option = f"--port {port}" if e.errno in (errno.EADDRINUSE, errno.EACCES) else f"--host {host}"
                raise ValueError(f"{option}: cannot listen on {address[0]}:{address[1]} ({e.strerror or e})") from None
    except BaseException:
        for s in sockets:
            s.close()
        raise
    return sockets


def _load_saved_cache(llm, folder: str | None) -> int | None:
    """The cache saved in ``folder`` loaded into ``llm`` (entries taken); None when no folder was given
    or nothing was saved there yet (a first run)."""
    from hypic.cache.persist import MANIFEST

    if not folder or not (Path(folder) / MANIFEST).exists():
        return None
    return llm.load_cache(folder)


def parse_workers(text: str) -> int | list[str]:
    """``--cold-workers``: a count (``2``) or devices (``cuda:1,cuda:2``)."""
    text = text.strip()
    if text.removeprefix("-").isdigit():  # -1: refused as a count, not as "'-1' is not a device"
        return int(text)
    devices = [d.strip() for d in text.split(",")]
    if not all(devices):  # '' ("$UNSET_VAR") ran with no workers, "cuda:1,,cuda:2" with two
        raise argparse.ArgumentTypeError(f"expected a count such as 2 (0: none) or devices such as cuda:1,cuda:2, "
                                         f"got {text!r}")
    return devices


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="the OpenAI-compatible server (completions, chat, segment pre-warming)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=parse_port, default=8000)
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1 and the tokenizer routes "
                                     "(/health and /metrics stay open; default: $HYPIC_API_KEY)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--warm-up", default="auto", choices=["auto", "on", "off"],
                   help="before listening, run every request path once on synthetic prompts, so the first "
                        "requests do not compile and tune kernels (a minute on a GPU); the cache and the "
                        "metrics are left as they were (default auto: on a GPU)")
    _served_options(p)
    p.set_defaults(func=serve)
    b = sub.add_parser("run-batch", help="answer a file of requests in OpenAI's batch format, as the server would")
    b.add_argument("-i", "--input", required=True, help="JSONL: {custom_id, method: POST, url, body} per line "
                   "(url /v1/chat/completions, /v1/completions or /v1/responses)")
    b.add_argument("-o", "--output", required=True, help="JSONL: {id, custom_id, response, error} per request")
    _served_options(b)
    b.set_defaults(func=run_batch)


def _served_options(p: argparse.ArgumentParser) -> None:
    """The model, engine and request options ``serve`` and ``run-batch`` share."""
    p.add_argument("--model", help="a model folder (default: the bundled model)")
    p.add_argument("--served-model-name", help="the id clients pass as `model` (default: the folder's name)")
    p.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--quantization", default="auto", choices=["auto", "fp8", "none"],
                   help="fp8: projections and experts held in 8 bits with row scales (half the weight memory); "
                        "none: every weight in --dtype; auto (default): fp8 for an FP8 checkpoint on a GPU")
    p.add_argument("--seam", type=int, default=8, help="seam window w: tokens of each cached segment recomputed")
    p.add_argument("--cold", default="standalone", choices=["standalone", "in_context"])
    p.add_argument("--cold-workers", type=parse_workers, default=0,
                   help="prefill cold segments on more devices too: a count (the next GPUs) or cuda:1,cuda:2")
    p.add_argument("--route", default="lpt", choices=["lpt", "round_robin"], help="how cold segments are spread")
    p.add_argument("--cache-device-bytes", type=parse_budget, default="auto",
                   help="device-tier budget, e.g. 20GiB, or none (default auto: on a GPU half the memory free "
                        "after loading the model; on the CPU half the memory available)")
    p.add_argument("--cache-host-bytes", type=parse_budget, default="auto",
                   help="host-tier budget, e.g. 64GiB, or none (default auto: on a GPU a quarter of physical "
                        "memory; on the CPU 0: both tiers would be the same memory)")
    p.add_argument("--cache-host-dtype", default="auto", choices=[*HOST_DTYPES, "auto"],
                   help="the host tier's summaries (T and S): bfloat16 holds nearly twice the entries there, "
                        "each rounded once on its way down (default auto: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--cache-dir", help="keep the segment cache across restarts: loaded from this folder at start "
                   "(if a cache was saved there), saved to it at shutdown and on POST /v1/segments/save")
    p.add_argument("--max-segments", type=int, default=256, help="segments per request")
    p.add_argument("--max-prompt-tokens", type=int, help="prompt tokens per request (default: the model's limit)")
    p.add_argument("--max-completion-tokens", type=int, default=2048, help="cap on max_tokens")
    p.add_argument("--max-concurrent", type=int, default=16, help="requests decoding together")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting; beyond it: 429")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="priority: waiting requests are admitted by their `priority` (lower first), then by "
                        "arrival (vLLM's); fcfs: by arrival, and a request's priority must be 0")
    p.add_argument("--max-choices", type=int, default=8, help="cap on a request's n (each choice is a request)")
    p.add_argument("--max-prompts", type=int, default=32,
                   help="cap on the prompts of one completions request (a batch; each prompt × n is a request)")
    p.add_argument("--max-prefill-tokens", type=int,
                   help="tokens computed by one prefill call, what the cache does not hold (default: no limit); "
                        "a prompt that would compute more has its missing documents prefilled ahead in "
                        "slices of this size between decode steps while others decode (not with --cold "
                        "in_context, nor for the full and prefix modes)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests may finish")
    p.add_argument("--shutdown-drain", action="store_true",
                   help="at shutdown, serve the queued requests within --shutdown-timeout too (default: a 503 "
                        "with Retry-After at once, for a load balancer to send them elsewhere)")
    p.add_argument("--max-stored-responses", type=int, default=1024,
                   help="Responses API: the latest responses kept in memory for previous_response_id (0: none)")
    p.add_argument("--reasoning-parser", choices=["think"],
                   help="chat answers' <think>…</think> returned as reasoning_content (Qwen3, Qwen3-Next, Qwen3.5)")


def generate(args: argparse.Namespace) -> int:
    from hypic.engine.request import SamplingParams
    from hypic.llm import LLM

    try:
        if args.cache_dir is not None:  # "" ran without a cache, silently
            _take_cache_dir(args.cache_dir)
        llm = LLM(args.model, device=args.device, seam=args.seam, quantization=_quantization(args.quantization))
        _load_saved_cache(llm, args.cache_dir)  # warm from an earlier run
        if args.beam_width is not None:
            return _beams(llm, args)
        schema = None
        if args.json_schema is not None:  # a file, or the JSON itself
            try:
                schema = json.loads(_file_or_text(args.json_schema))
            except ValueError as e:
                raise ValueError(f"--json-schema: neither a file nor JSON ({e})") from None
        grammar = None if args.grammar is None else _file_or_text(args.grammar)
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty, json_schema=schema, grammar=grammar,
                            regex=args.regex)
        for _ in range(args.repeat):
            out = llm.generate(args.prompt, sp, mode=args.mode)[0]
            m = out.metrics
            print(out.text)
            print(f"[{args.mode}] ttft {1000 * m.ttft_s:.1f} ms · prompt {m.prompt_tokens} · "
                  f"cached {m.cached_tokens} · recomputed {m.recomputed_tokens} · hits {m.segment_hits} · "
                  f"misses {m.segment_misses}", file=sys.stderr)
        if args.cache_dir:
            llm.save_cache(args.cache_dir)
    except (ValueError, OSError) as e:
        print(f"hypic generate: {flagged(e, args) if isinstance(e, ValueError) else e}", file=sys.stderr)
        return 2
    return 0


def _beams(llm: object, args: argparse.Namespace) -> int:
    """``generate --beam-width``: the beams the search keeps, best first, each with its summed
    log-probability and how it ended."""
    from hypic.engine.beam_search import BeamSearchParams

    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens)
    for _ in range(args.repeat):
        for beam in llm.beam_search(args.prompt, params, mode=args.mode)[0].sequences:
            print(f"{beam.cum_logprob:9.3f}  [{beam.finish_reason}] {beam.text}")
    if args.cache_dir:
        llm.save_cache(args.cache_dir)
    return 0


def _file_or_text(value: str) -> str:
    """A file's text, or the value itself: a grammar or schema written out is no file name (and
    may be too long to be one: asking the system whether it is a file would fail)."""
    try:
        return Path(value).read_text() if Path(value).is_file() else value
    except OSError:
        return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hypic", description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="the main job: a short end-to-end run on the bundled model")
    p_demo.add_argument("--model", help="model folder (default: the bundled model)")
    p_demo.add_argument("--device")
    p_demo.add_argument("--questions", type=positive_int, default=3)
    p_demo.add_argument("--self-check", action="store_true", help="run the algebra self-check instead (no model)")
    p_demo.add_argument("--length", type=int, default=300,
                        help=f"span length of the algebra self-check (1 to {MAX_CHECK_LENGTH})")
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.set_defaults(func=demo)
    p_gen = sub.add_parser("generate", help="answer one prompt (segments split on <<PIC_SEP>>)")
    p_gen.add_argument("prompt")
    p_gen.add_argument("--model", help="model folder (default: the bundled model)")
    p_gen.add_argument("--device")
    p_gen.add_argument("--mode", default="hypic", choices=list(MODES))
    p_gen.add_argument("--seam", type=int, default=8)
    p_gen.add_argument("--max-tokens", type=int, default=32)
    p_gen.add_argument("--cache-dir", help="load the segment cache from this folder first (if saved there) and "
                       "save it back after: the next run is warm")
    p_gen.add_argument("--temperature", type=float, default=0.0)
    p_gen.add_argument("--seed", type=int)
    p_gen.add_argument("--top-p", type=float, default=1.0)
    p_gen.add_argument("--top-k", type=int, default=0, help="0: off")
    p_gen.add_argument("--min-p", type=float, default=0.0)
    p_gen.add_argument("--repetition-penalty", type=float, default=1.0)
    p_gen.add_argument("--repeat", type=positive_int, default=1,
                       help="ask again (the second time the segments are cached)")
    p_gen.add_argument("--json-schema", help="answer in JSON this schema accepts: a file or the JSON itself "
                       "('true': any JSON value)")
    p_gen.add_argument("--grammar", help="answer with text this grammar derives (GBNF, root ::= …, or Lark, "
                       "start: …): a file or the grammar itself")
    p_gen.add_argument("--regex", help="answer with text this regular expression matches whole")
    p_gen.add_argument("--beam-width", type=int, help="beam search: print this many beams, best first, each "
                       "with its summed log-probability (at most 10)")
    p_gen.add_argument("--quantization", default="auto", choices=["auto", "fp8", "none"],
                       help="fp8: projections and experts held in 8 bits; auto: fp8 for an FP8 checkpoint on a GPU")
    p_gen.set_defaults(func=generate)
    add_bench_parser(sub)
    p_eval = sub.add_parser("eval", help="evaluations")
    eval_sub = p_eval.add_subparsers(dest="eval", required=True)
    p_q = eval_sub.add_parser("quality", help="task quality across the mode ladder")
    p_q.add_argument("--model", help="model folder (default: the bundled model)")
    p_q.add_argument("--quick", action="store_true", help="a few short examples per family (CI)")
    p_q.add_argument("--json", action="store_true", help="print one JSON object with per-mode scores")
    p_q.add_argument("--n", type=int, help="examples per family (default 200; 4 with --quick)")
    p_q.add_argument("--difficulty", type=unit_interval)
    p_q.add_argument("--labels", help="comma list of mode labels (default: all)")
    p_q.add_argument("--device")
    p_q.add_argument("--dtype", choices=["float32", "bfloat16"])
    p_q.add_argument("--quantization", default="auto", choices=["auto", "fp8", "none"],
                     help="fp8: projections and experts held in 8 bits; none; auto: fp8 for an FP8 checkpoint on a GPU")
    p_q.add_argument("--batch", type=positive_int, default=8, help="prompts per engine call")
    p_q.add_argument("--out", help="write the markdown report here (a .md path; the plot and the JSON summary "
                                   "beside it), rewritten after every label")
    p_q.set_defaults(func=eval_quality)
    p_d = eval_sub.add_parser("deviation", help="per-layer deviation from full across the mode ladder")
    p_d.add_argument("--model", help="model folder (default: the bundled model)")
    p_d.add_argument("--n", type=int, default=50, help="examples per family")
    p_d.add_argument("--difficulty", type=unit_interval, default=1.0)
    p_d.add_argument("--labels", help="comma list of mode labels (default: full, prefix, zero_state, naive, "
                                      "addition, transition, hypic_w0, hypic_w8)")
    p_d.add_argument("--device")
    p_d.add_argument("--dtype", choices=["float32", "bfloat16"])
    p_d.add_argument("--batch", type=positive_int, default=8, help="prompts per engine call")
    p_d.add_argument("--json", action="store_true", help="print one JSON object")
    p_d.add_argument("--out", help="write the markdown tables here")
    p_d.set_defaults(func=eval_deviation)
    _serve_parser(sub)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv  # the command line, for the tables' footers
    out = getattr(args, "out", None)
    try:
        if out is not None:  # found after the run, each lost the run (a folder: a traceback)
            if not out.strip():
                raise ValueError("--out: empty path (leave it out to print only)")
            if Path(out).is_dir() and args.command != "eval":  # eval's report says more (_check_report_out)
                raise ValueError(f"--out {out}: a folder; expected a file path")
            if not Path(out).resolve().parent.is_dir():
                raise ValueError(f"--out {out}: its folder does not exist")
        return args.func(args)
    except ValueError as e:  # the library's checks name what is wrong: one line, not a traceback
        print(f"hypic {args.command}: {flagged(e, args)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
