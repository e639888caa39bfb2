"""The TTFT benchmark runs end to end on a tiny random model (timings are not asserted)."""

import pytest
import torch

from hypic.bench.shapes import SHAPES
from hypic.bench.ttft import RagShape, rag_prompts, report, run
from hypic.cli import main
from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams
from hypic.models.random_init import random_model


def test_rag_prompts_shuffle_one_document_pool() -> None:
    shape = RagShape(docs=5, doc_tokens=7, head_tokens=3, query_tokens=2)
    a, b = rag_prompts(shape, 100, 2, seed=1)
    assert a[0] == b[0] and sorted(map(tuple, a[1:-1])) == sorted(map(tuple, b[1:-1])) and a[-1] != b[-1]
    assert rag_prompts(shape, 100, 2, seed=1) == [a, b]


def test_ttft_rows_and_recompute_set(tmp_path) -> None:
    engine = Engine(random_model(SHAPES["tiny"], device="cpu", dtype=torch.float32), seam=4)
    shape = RagShape(docs=4, doc_tokens=40, head_tokens=20, query_tokens=6)
    res = run(engine, shape, reps=2)
    assert res["recompute_tokens"] == 5 * 4 + 6  # head and documents: their seams; the query: all of it
    assert all(res[k] > 0 for k in ("full", "prefix", "hypic_warm", "hypic_cold", "lower_bound", "bytes_per_doc"))
    assert "hypic warm" in report(res, shape, "tiny")
    out = tmp_path / "bench.md"
    assert main(["bench", "ttft", "--shape", "tiny", "--docs", "3", "--doc-tokens", "30", "--head-tokens", "10",
                 "--query-tokens", "4", "--reps", "1", "--out", str(out)]) == 0
    assert "Command: `hypic bench ttft" in out.read_text()


def test_sync_report_groups_by_the_innermost_hypic_line(monkeypatch, tmp_path) -> None:
    """The sync finder's bookkeeping (CUDA's sync debug mode itself needs a GPU): a warning raised
    from inside the engine is counted under the engine's source line — also when torch's frame
    that raised it lies in a folder named hypic (a checkout's .venv), which is not the package."""
    import warnings

    from hypic.bench import syncs
    from tests.engine.test_host_ops import torch_like_function

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    engine = Engine(random_model(SHAPES["tiny"], device="cpu", dtype=torch.float32), seam=4)
    original = engine.model.forward
    sync, _ = torch_like_function(tmp_path, "def sync(warn):\n    warn('called a synchronizing CUDA operation')\n",
                                  "sync")

    def forward(*args, **kwargs):
        sync(warnings.warn)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", forward)
    prompt = rag_prompts(RagShape(docs=2, doc_tokens=12, head_tokens=5, query_tokens=3), 100, 1)[0]
    sites = syncs.sync_sites(engine, prompt, ("full",))
    assert sum(sites["full"].values()) == 1
    (site,) = sites["full"]
    assert site.startswith("engine/") and "model(" in site
    assert "## full: 1 syncs" in syncs.format_sites(sites)


def test_ab_rows_undo_one_switch_each_and_restore_it() -> None:
    """``--ab`` rows: warm requests with one warm-path change undone, the switch restored after."""
    import hypic.ops.conv as conv
    import hypic.ops.kernels as kernels

    before = (kernels.RECURRENT_MAX, conv._FLA_CONV)
    engine = Engine(random_model(SHAPES["tiny"], device="cpu", dtype=torch.float32), seam=4)
    shape = RagShape(docs=3, doc_tokens=20, head_tokens=8, query_tokens=4)
    res = run(engine, shape, reps=1, ab=True)
    assert res["warm_chunked_short_runs"] > 0 and res["warm_fla_conv"] > 0
    assert (kernels.RECURRENT_MAX, conv._FLA_CONV) == before
    assert "A/B: hypic warm, chunked short runs" in report(res, shape, "tiny")


def test_warm_rows_are_measured_round_robin_with_spread(monkeypatch) -> None:
    """Each prompt runs warm, every A/B row and the lower bound back to back (so host noise hits
    them alike); every row reports p50 within its min–max."""
    import hypic.bench.ttft as ttft

    order: list[str] = []
    real_ttft, real_lb = ttft._ttft, ttft._lower_bound

    def spy_ttft(engine, prompt, mode):
        order.append(f"{mode}:{ttft.importlib.import_module('hypic.ops.kernels').RECURRENT_MAX}")
        return real_ttft(engine, prompt, mode)

    def spy_lb(engine, tokens, vocab):
        order.append("lb")
        return real_lb(engine, tokens, vocab)

    monkeypatch.setattr(ttft, "_ttft", spy_ttft)
    monkeypatch.setattr(ttft, "_lower_bound", spy_lb)
    engine = Engine(random_model(SHAPES["tiny"], device="cpu", dtype=torch.float32), seam=4)
    res = run(engine, RagShape(docs=3, doc_tokens=20, head_tokens=8, query_tokens=4), reps=3, ab=True)
    tail = order[order.index("lb") + 1:]  # after the lower bound's warm-up call
    per_prompt = len(ttft.AB_SWITCHES) + 2
    assert len(tail) == 3 * per_prompt and all(tail[i * per_prompt + per_prompt - 1] == "lb" for i in range(3))
    assert tail[1].endswith(":0")  # the chunked-short-runs row sits between warm requests
    for key in ("full", "prefix", "hypic_cold", "hypic_warm", "lower_bound", *ttft.AB_SWITCHES):
        assert res[f"{key}_min"] <= res[key] <= res[f"{key}_max"]
    assert res["warm_over_lower_bound"] > 0


@pytest.mark.gpu
def test_on_a_gpu_a_decode_step_reads_back_once_whatever_its_rows_ask_for() -> None:
    """CUDA's sync debug mode over decode steps of the bundled model: greedy, sampled, penalized,
    with logprobs, structured, and all mixed row by row — one read-back a step (the tokens, the
    log-probabilities with them); a stall per row or per feature fails it."""
    from hypic import LLM
    from hypic.bench import syncs

    llm = LLM(device="cuda", dtype="float32")
    prompts = [llm.tokenize([f"Profile of Mira{i}. Mira lives in Quorvane.", "Question: where?\nAnswer:"])
               for i in range(6)]
    features = dict(syncs.STEP_FEATURES)
    features["structured"] = SamplingParams(max_tokens=16, json_schema={"type": "object"}, temperature=1.0, seed=2)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(syncs, "STEP_FEATURES", features)
    try:
        sites = syncs.step_sync_sites(llm.engine, prompts, steps=3)
    finally:
        monkeypatch.undo()
    assert len(sites) == len(features) + 1
    for name, counts in sites.items():
        assert sum(counts.values()) <= 3, syncs.format_sites({name: counts}).replace("\n", " | ")
