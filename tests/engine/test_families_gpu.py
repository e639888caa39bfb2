"""Every family on the GPU — fla's kernels for its linear layers, flash attention, the combine
pass's GPU paths — against the same checkpoint on the CPU, in fp32: `full` and `hypic` cold, then
`hypic` warm with the documents in a new order. The bound is fp32's TF32 noise on the H200 (a
scoring logprob moved by up to 7.1e-3, session 21), relative to the logits' scale where that is
above 1, not an exactness claim: the CPU tests hold those.
"""

import pytest
import transformers as T

from hypic import LLM
from tests.engine.conftest import BUILDERS
from tests.engine.test_families import FAMILIES, SCALED, _logits, _segments

GPU_VS_CPU = 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES + SCALED)
def test_on_a_gpu_every_family_answers_as_on_the_cpu(family, tmp_path) -> None:
    if family == "kimi_linear" and not hasattr(T, "KimiLinearForCausalLM"):
        pytest.skip(f"transformers {T.__version__} has no Kimi-Linear to build the checkpoint with")
    path = str(BUILDERS[family](tmp_path / family))
    cpu, gpu = LLM(path, device="cpu"), LLM(path, device="cuda", dtype="float32")
    prompt = _segments(5, [16, 120, 90, 10])
    reordered = [prompt[0], prompt[2], prompt[1], prompt[3]]
    for mode, p, hits in (("full", prompt, 0), ("hypic", prompt, 0), ("hypic", reordered, 3)):
        want, (got, metrics) = _logits(cpu, p, mode)[0], _logits(gpu, p, mode)
        assert metrics.segment_hits == hits  # the new order is served warm: head and both documents
        bound = GPU_VS_CPU * max(1.0, float(want.abs().max()))  # TF32's error grows with the logits' scale
        assert (got.cpu() - want).abs().max() <= bound, (mode, float((got.cpu() - want).abs().max()), bound)
