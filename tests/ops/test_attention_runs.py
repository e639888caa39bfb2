"""The combine pass's attention by runs (``ops.attention_runs``): each run sees its request's keys up
to its own last row, causally among its own rows.

On the CPU a loop over the plan's runs stands in for flash attention's varlen kernel, so the plan the
combine pass builds (where each run's rows and keys are) is checked against the general path — a
bias per request — through whole warm and cold requests. On a GPU the kernel itself is checked
against that loop (``gpu``)."""

import pytest
import torch

from hypic.ops import attention_runs
from hypic.ops.attention_runs import RunsPlan


def runs_reference(q, k, v, plan: RunsPlan, scale: float):
    """The plan's meaning, run by run, in fp32: bottom-right causal over each run's visible keys."""
    cu, starts, used = plan.cu_rows.tolist(), plan.cu_keys.tolist(), plan.used.tolist()
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    rep = q.shape[1] // k.shape[1]
    for j, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        keys = k[starts[j]:starts[j] + used[j]].float().repeat_interleave(rep, 1)  # [n, Hq, D]
        vals = v[starts[j]:starts[j] + used[j]].float().repeat_interleave(rep, 1)
        s = torch.einsum("rhd,nhd->hrn", q[a:b].float(), keys) * scale
        rows, n = b - a, used[j]
        visible = torch.arange(n, device=q.device)[None, :] <= (n - rows + torch.arange(rows, device=q.device))[:, None]
        s = s.masked_fill(~visible[None], float("-inf"))
        out[a:b] = torch.einsum("hrn,nhd->rhd", s.softmax(-1), vals).to(q.dtype)
    return out


def test_the_combine_pass_plans_its_runs_as_the_general_path_sees_them(monkeypatch) -> None:
    """Warm and cold hypic requests (several per call, seams, in-context misses) with the runs path
    forced on and computed by the reference loop give the logits of the general path."""
    from hypic.bench.shapes import SHAPES
    from hypic.bench.ttft import RagShape, rag_prompts
    from hypic.engine.engine import Engine
    from hypic.models.random_init import random_model

    loaded = random_model(SHAPES["tiny"], device="cpu", dtype=torch.float32)
    prompts = rag_prompts(RagShape(4, 20, 6, 5), loaded.model.vocab_size, 3, seed=2)
    calls = []

    def reference(q, k, v, plan, scale):
        calls.append(plan)
        return runs_reference(q, k, v, plan, scale)

    results = {}
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(attention_runs, "supported", lambda q, k, v: True)
            monkeypatch.setattr(attention_runs, "runs_attention", reference)
        engine = Engine(loaded, seam=3)
        cold = engine.prefill_logits([prompts[0]], mode="hypic")[0]  # cold: the misses in the same forward
        warm = engine.prefill_logits(prompts[1:], mode="hypic")[0]  # two warm requests in one call
        results[forced] = torch.cat([cold, warm])
    assert calls and max(len(p.used) for p in calls) > 3  # the runs path ran, with several runs a call
    assert (results[False] - results[True]).abs().max() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_a_gpu_flash_by_runs_matches_the_reference(dtype: torch.dtype, monkeypatch) -> None:
    """Two requests' keys packed; runs of 1, 8 and 40 rows, several sharing a request's key start."""
    monkeypatch.setenv("HYPIC_COMBINE_FLASH", "1")
    g = torch.Generator(device="cuda").manual_seed(0)
    runs = [(0, 8, 0, 8), (8, 9, 0, 30), (9, 49, 0, 90), (49, 57, 90, 8), (57, 58, 90, 60)]  # rows, key start, used
    q = torch.randn(58, 16, 128, device="cuda", generator=g).to(dtype)
    k = torch.randn(150, 4, 128, device="cuda", generator=g).to(dtype)
    v = torch.randn(150, 4, 128, device="cuda", generator=g).to(dtype)
    plan = RunsPlan(torch.tensor([0, *[r[1] for r in runs]], dtype=torch.int32, device="cuda"),
                    torch.tensor([*[r[2] for r in runs], 150], dtype=torch.int32, device="cuda"),
                    torch.tensor([r[3] for r in runs], dtype=torch.int32, device="cuda"), 40, 150)
    assert attention_runs.supported(q, k, v)
    got = attention_runs.runs_attention(q, k, v, plan, 128**-0.5)
    want = runs_reference(q, k, v, plan, 128**-0.5)
    assert (got.float() - want.float()).abs().max() < 2e-2
