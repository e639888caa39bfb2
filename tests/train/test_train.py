"""Training path: gradients through the chunked kernel, packing, a short run that learns, resume."""

import json

import numpy as np
import pytest
import torch

from hypic.eval.tasks import generate
from hypic.eval.tokenizer import END, corpus, encode_example, train_tokenizer
from hypic.ops.linear import linear_attention
from hypic.ops.samples import family_inputs, token_kwargs
from hypic.train.data import encode_item, pack
from hypic.train.loop import main


def test_chunked_kernel_gradients_match_finite_differences() -> None:
    x = family_inputs("gdn", 70, heads=1, value_heads=2, key_dim=4, value_dim=3, seed=2)
    names = ["q", "k", "v", "g", "beta"]
    args = [x[n].clone().requires_grad_(True) for n in names]

    def f(q, k, v, g, beta):
        out = linear_attention("gdn", q, k, v, g=g, beta=beta, cu_seqlens=torch.tensor([0, 33, 70]))
        return out.o, out.final_state

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6)
    assert token_kwargs(x)


def test_pack_weights_answers() -> None:
    items = [(np.array([5, 6, 7, 8, 9, 4, 3]), np.array([0, 0, 0, 1, 0, 0, 1], np.uint8), np.array([1, 1])),
             (np.array([1, 2, 3]), np.array([0, 0, 1], np.uint8), np.array([1]))]
    b = pack(items, doc_weight=0.1)
    assert b.lengths == [6, 2] and b.input_ids.tolist() == [5, 6, 7, 8, 9, 4, 1, 2]
    assert b.labels.tolist() == [6, 7, 8, 9, 4, 3, 2, 3]
    assert b.weights.tolist() == pytest.approx([0.1, 0.1, 1.0, 0.1, 0.1, 1.0, 0.1, 1.0]) and b.answer_tokens == 3
    assert b.segments == [[1, 1, 4], [1, 1]]
    assert b.first.tolist() == [False, False, True, False, False, True, False, True]


def test_items_carry_extra_questions_after_the_answer(tmp_path) -> None:
    tok = train_tokenizer(corpus(3, [-1], difficulties=(0.0,)), 512)
    ex = generate("single_hop", 1, 3, difficulty=0.2)[0]
    tokens, answer, segs = encode_item(tok, ex, extra=2)
    enc = encode_example(tok, ex)
    prompt = [t for s in enc.segments for t in s]
    assert tokens[:len(prompt) + len(enc.target)].tolist() == prompt + enc.target
    assert segs.tolist() == [len(s) for s in enc.segments[:-1]]
    text = tok.decode(tokens[len(prompt):].tolist(), skip_special_tokens=False)
    assert text.count("Question:") == 2 and text.count(END) == 3 and ex.extra[1][1] in text
    assert int(answer.sum()) == len(enc.target) + sum(len(tok.encode(a).ids) + 1 for _, a in ex.extra[:2])


def test_short_run_learns_saves_and_resumes(tmp_path) -> None:
    tok = train_tokenizer(corpus(5, [-1], difficulties=(0.0,)), 512)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    out = tmp_path / "run"
    common = ["--out", str(out), "--preset", "tiny", "--device", "cpu", "--batch-tokens", "1500", "--workers", "0",
              "--log-every", "10", "--ramp-steps", "100000", "--warmup", "5", "--lr", "3e-3",
              "--extra-questions", "4", "--standalone-every", "3"]
    assert main([*common, "--tokenizer", str(tok_dir), "--minutes", "5", "--total-steps", "40"]) == 0
    state = json.loads((out / "train_state.json").read_text())
    assert state["step"] == 40 and state["log"][-1]["loss"] < state["log"][0]["loss"] - 0.5
    assert all(f.stat().st_size < 15 * 2**20 for f in out.glob("*.safetensors"))
    assert main([*common, "--resume", "--minutes", "5", "--total-steps", "45"]) == 0
    assert json.loads((out / "train_state.json").read_text())["step"] == 45
    from hypic import LLM, SamplingParams

    llm = LLM(str(out), device="cpu")
    assert llm.generate("Question: Who?\nAnswer:", SamplingParams(max_tokens=3))[0].token_ids
    from hypic.train.export import export

    assert export(out, tmp_path / "bundled") > 0  # bf16 weights, config, tokenizer: a model folder
    bundled = LLM(str(tmp_path / "bundled"), device="cpu")
    assert bundled.generate("Question: Who?\nAnswer:", SamplingParams(max_tokens=1))[0].token_ids
