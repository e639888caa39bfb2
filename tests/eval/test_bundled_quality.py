"""`hypic eval quality --quick` on the bundled model, with asserted bounds (CPU, ~30 s).

The bounds are what the shipped model must keep: exact reuse (`prefix`) scores exactly as `full`,
the model answers well above chance, hypic's reuse stays close to `full` and above naive state
addition, and naive disagrees far more with `full` on the first token. Measured for the step-17900
model (docs/quality.md, session 9): full 96.9, hypic_w8 100.0 (one two-hop question of 4 that
`full` misses), naive 86.2; first-token KL to `full` naive 0.163, hypic_w8 0.003 (53×; step 16203:
full 96.9, naive 86.0, KL 0.191 against 0.005); `zero_state` (linear states dropped between
segments) 65.2, KL 0.999 (session 11): the linear layers' state matters, summed or not. At
difficulty 0.3 naive loses few points (few documents to add up), so its score bound is loose and
the KL ratio carries the sensitivity check; the bounds sit below the measured values by the noise
of 4 examples per family, so a retrained model that is no worse passes and a broken engine or a
broken export does not.
"""

import json

import pytest

from hypic.cli import main as cli
from hypic.llm import bundled_model_path

pytestmark = pytest.mark.skipif(not bundled_model_path().is_dir(), reason="no bundled model in this checkout")


def test_quick_quality_of_the_bundled_model(capsys) -> None:
    assert cli(["eval", "quality", "--quick", "--json", "--labels", "full,prefix,naive,zero_state,hypic_w8"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    scores = out["scores"]
    assert out["difficulty"] == 0.3 and out["examples_per_family"] == 4
    assert scores["prefix"] == pytest.approx(scores["full"], abs=1e-9)  # exact reuse
    assert scores["full"] >= 80.0
    assert scores["full"] - scores["hypic_w8"] <= 5.0  # position-independent reuse stays close
    assert scores["full"] - scores["naive"] >= 4.0  # naive addition loses
    assert scores["hypic_w8"] >= scores["naive"]
    assert scores["full"] - scores["zero_state"] >= 20.0  # what the linear layers carry across segments
    assert scores["zero_state"] < scores["naive"]
    assert out["top1"]["prefix"] == 100.0
    assert out["kl"]["naive"] >= 10 * out["kl"]["hypic_w8"]  # the first token: naive strays, hypic does not
