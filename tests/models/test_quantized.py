"""FP8 checkpoints (``quant_method: "fp8"``): 8-bit weights with block, row or tensor scales load
as the products the scales define — checked against weights dequantized here by direct indexing
in fp64 (another computation than the loader's) and against transformers running those weights;
malformed ones are refused by name."""

import json
import re
import shutil

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from hypic.models.loader import load_model
from tests.models.harness import (
    TINY_BASE,
    TINY_GDN,
    TINY_MOE,
    assert_greedy_matches_transformers,
    assert_prefill_matches_transformers,
    hypic_logits,
    randomize_norms,
)

E4M3_MAX = 448.0
# what Qwen's FP8 builds leave in bf16 (their modules_to_not_convert), besides 1-D tensors
KEPT = ("embed_tokens", "lm_head", "in_proj_ba", "mlp.gate.", "shared_expert_gate", "conv1d")


def _quantized(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and not any(k in name for k in KEPT)


def quantize_blocks(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 as the FP8 builds store it: per block, scale = amax / 448 (stored bf16) and
    q = w / scale rounded to e4m3."""
    out, inp = w.shape
    br, bc = -(-out // rows), -(-inp // cols)
    scale = torch.empty(br, bc)
    for i in range(br):
        for j in range(bc):
            block = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            scale[i, j] = block.abs().max().clamp(min=1e-12) / E4M3_MAX
    scale = scale.bfloat16()
    full = scale.float().repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :inp]
    return (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantized_by_index(q: torch.Tensor, scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The reference: element (i, j) times the scale of block (i // rows, j // cols), in fp64."""
    i = torch.arange(q.shape[0])[:, None] // rows
    j = torch.arange(q.shape[1])[None, :] // cols
    return (q.double() * scale.double()[i, j]).float()  # a 4-bit by 8-bit mantissa product: exact in fp32


def write_fp8(ref: torch.nn.Module, path, rows: int | None, cols: int | None,
              compressed: bool = False) -> dict[str, torch.Tensor]:
    """``ref``'s weights as an fp8 checkpoint in two shards, every scale in the second (apart from
    its weight): block scales (``rows`` × ``cols``) or, ``rows`` None, one fp32 scale per output
    row; as Hugging Face's fp8 writes it, or ``compressed``, as compressed-tensors does (llm-compressor:
    scales named ``weight_scale`` whatever the strategy). Returns the dequantized state dict the
    checkpoint stands for."""
    ref.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    weights, scales, expected = {}, {}, {}
    block_suffix = "_scale" if compressed else "_scale_inv"
    for name, t in tensors.items():
        if not _quantized(name, t):
            weights[name] = expected[name] = t
        elif rows is None:
            s = (t.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX).float()
            weights[name] = (t / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            scales[name + "_scale"] = s
            expected[name] = (weights[name].double() * s.double()).float()
        else:
            weights[name], scales[name + block_suffix] = quantize_blocks(t, rows, cols)
            expected[name] = dequantized_by_index(weights[name], scales[name + block_suffix], rows, cols)
    save_file(weights, path / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(scales, path / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    index = {n: "model-00001-of-00002.safetensors" for n in weights}
    index |= {n: "model-00002-of-00002.safetensors" for n in scales}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    cfg = json.loads((path / "config.json").read_text())
    if compressed:
        strategy = {"strategy": "channel"} if rows is None else {"strategy": "block", "block_structure": [rows, cols]}
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True, **strategy},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head"]}
    else:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      **({"weight_block_size": [rows, cols]} if rows is not None else {}),
                                      "modules_to_not_convert": ["lm_head", "embed_tokens"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return expected


@pytest.fixture(scope="module")
def qwen3_next_fp8(tmp_path_factory):
    """Qwen3-Next with MoE experts one tensor each, as Qwen's FP8 build stores them; 32 × 48 blocks:
    ragged along 128-wide inputs, several per projection."""
    torch.manual_seed(0)
    ref = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**TINY_BASE, **TINY_GDN, **TINY_MOE, intermediate_size=256)).eval()
    randomize_norms(ref)
    path = tmp_path_factory.mktemp("fp8")
    expected = write_fp8(ref, path, 32, 48)
    plain = write_plain(path, expected, tmp_path_factory.mktemp("plain"))
    return T.Qwen3NextForCausalLM.from_pretrained(plain).eval(), path, expected, plain


def write_plain(fp8, expected: dict[str, torch.Tensor], path):
    """The dequantized weights as an ordinary checkpoint (what transformers runs as the reference)."""
    shutil.copytree(fp8, path, dirs_exist_ok=True)
    for f in path.glob("*.safetensors*"):
        f.unlink()
    save_file(expected, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_block_scaled_weights_load_as_their_products(qwen3_next_fp8) -> None:
    ref, path, expected, _ = qwen3_next_fp8
    loaded = load_model(path, device="cpu")
    got = dict(loaded.model.named_parameters())
    experts = 0
    for name, want in expected.items():
        if m := re.match(r"(.*\.experts)\.(\d+)\.(\w+)\.weight$", name):  # hypic stacks them: experts.up_proj[e]
            param, experts = got[f"{m[1]}.{m[3]}"][int(m[2])], experts + 1
        else:
            param = got[name]
        assert torch.equal(param, want), name
    assert experts == TINY_MOE["num_experts"] * 3 * TINY_BASE["num_hidden_layers"]  # every expert checked
    assert_prefill_matches_transformers(ref, loaded)
    assert_greedy_matches_transformers(ref, loaded)


def test_an_fp8_checkpoint_serves_what_its_dequantized_copy_serves(qwen3_next_fp8) -> None:
    """bf16 serving: the 8-bit weights rounded once into the model's dtype, as the dequantized
    checkpoint's are."""
    _, path, _, plain = qwen3_next_fp8
    ids = torch.randint(3, 512, (90,), generator=torch.Generator().manual_seed(5))
    a, b = load_model(path, device="cpu", dtype="bfloat16"), load_model(plain, device="cpu", dtype="bfloat16")
    assert torch.equal(hypic_logits(a, ids), hypic_logits(b, ids))


def test_row_scaled_weights_load_as_their_products(tmp_path) -> None:
    torch.manual_seed(1)
    ref = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**TINY_BASE, **TINY_GDN, intermediate_size=256)).eval()
    randomize_norms(ref)
    expected = write_fp8(ref, tmp_path / "fp8", None, None)
    loaded = load_model(tmp_path / "fp8", device="cpu")
    got = dict(loaded.model.named_parameters())
    quantized = [n for n in expected if n in got and _quantized(n, expected[n])]
    assert len(quantized) >= 4 * TINY_BASE["num_hidden_layers"]
    for name in quantized:
        assert torch.equal(got[name], expected[name]), name
    ref = T.Qwen3_5ForCausalLM.from_pretrained(write_plain(tmp_path / "fp8", expected, tmp_path / "plain")).eval()
    assert_prefill_matches_transformers(ref, loaded)


def _edit(src, dst, config=None, shard=None):
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if shard is not None:
        name, edit = shard
        tensors = load_file(dst / name)
        edit(tensors)
        save_file(tensors, dst / name, metadata={"format": "pt"})
    return dst


WEIGHT = "model.layers.0.linear_attn.out_proj.weight"
SCALES = "model-00002-of-00002.safetensors"
WEIGHTS = "model-00001-of-00002.safetensors"


@pytest.mark.parametrize("config, shard, message", [
    (lambda c: c["quantization_config"].update(quant_method="gptq"), None, "quant_method 'gptq' is not supported"),
    (lambda c: c["quantization_config"].update(weight_block_size=[128]), None, "weight_block_size must be two"),
    (lambda c: c.__setitem__("quantization_config", "fp8"), None, "quantization_config must be an object"),
    (lambda c: c.pop("quantization_config"), None, r"weight. is stored as torch.float8_e4m3fn.*no quantization_config"),
    (None, (SCALES, lambda t: t.pop(WEIGHT + "_scale_inv")), f"{WEIGHT}.*_scale_inv' is in no file"),
    (None, (SCALES, lambda t: t.__setitem__(WEIGHT + "_scale_inv", t[WEIGHT + "_scale_inv"][:, :2].clone())),
     r"out_proj.weight'.*block scales have shape \[4, 2\].*needs \[4, 3\]"),
    (None, (WEIGHTS, lambda t: t.__setitem__(WEIGHT, t[WEIGHT].float())),
     f"{WEIGHT}_scale_inv' scales.*not stored as 8-bit"),
])
def test_malformed_fp8_checkpoints_are_refused_by_name(qwen3_next_fp8, tmp_path, config, shard, message) -> None:
    path = _edit(qwen3_next_fp8[1], tmp_path / "bad", config, shard)
    with pytest.raises(ValueError, match=message):
        load_model(path, device="cpu")


def test_activation_scales_are_read_past(qwen3_next_fp8, tmp_path) -> None:
    """A static activation scheme's input scales are for 8-bit matmuls, which hypic does not run."""
    path = _edit(qwen3_next_fp8[1], tmp_path / "static",
                 lambda c: c["quantization_config"].update(activation_scheme="static"),
                 (SCALES, lambda t: t.__setitem__(WEIGHT[:-len("weight")] + "input_scale", torch.tensor(0.5))))
    plain = load_model(qwen3_next_fp8[1], device="cpu")
    static = load_model(path, device="cpu")
    ids = torch.arange(3, 40)
    assert torch.equal(hypic_logits(plain, ids), hypic_logits(static, ids))


def test_an_fp8_build_can_stay_in_8_bits(qwen3_next_fp8) -> None:
    """``quantization="fp8"`` over an FP8 build: each weight read as its block products, then held
    per row in 8 bits (a second rounding, within e4m3's step of the first)."""
    _, path, expected, plain = qwen3_next_fp8
    held = load_model(path, device="cpu", quantization="fp8")
    params = dict(held.model.named_parameters())
    weight = "model.layers.0.linear_attn.out_proj.weight"
    assert params[weight].dtype == torch.float8_e4m3fn
    back = params[weight].double() * params[weight + "_scale"].double()[:, None]
    want = expected[weight].double()
    assert ((back - want).abs() <= want.abs() / 16 + want.abs().amax(1, keepdim=True) * 2 ** -9 / 448).all()
    ids = torch.randint(3, 512, (80,), generator=torch.Generator().manual_seed(6))
    a, b = hypic_logits(load_model(plain, device="cpu"), ids), hypic_logits(held, ids)
    assert (a - b).norm() / a.norm() <= 0.1 and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_auto_keeps_an_fp8_build_in_8_bits_on_a_gpu_only(qwen3_next_fp8) -> None:
    """``quantization="auto"`` (the default): an FP8 build stays in 8 bits where 8-bit matmuls run
    (an 80B FP8 build dequantized would not fit one GPU); on the CPU, and for any other checkpoint,
    the weights are held in the serving dtype."""
    from hypic.models.quantized import resolved_quantization

    _, path, _, plain = qwen3_next_fp8
    fp8_config = json.loads((path / "config.json").read_text())
    plain_config = json.loads((plain / "config.json").read_text())
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # devices named only: nothing runs on them
    assert resolved_quantization("auto", fp8_config, cuda) == "fp8"
    assert resolved_quantization("auto", fp8_config, cpu) is None
    assert resolved_quantization("auto", plain_config, cuda) is None
    assert resolved_quantization(None, fp8_config, cuda) is None
    assert resolved_quantization("fp8", plain_config, cpu) == "fp8"
    assert load_model(path, device="cpu").quantization is None


@pytest.mark.parametrize("rows, cols", [(None, None), (32, 48)])
def test_compressed_tensors_fp8_builds_load_as_their_products(tmp_path, rows, cols) -> None:
    """llm-compressor's FP8 builds (compressed-tensors, float-quantized): channel or block scales,
    all named ``weight_scale``."""
    torch.manual_seed(2)
    ref = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**TINY_BASE, **TINY_GDN, **TINY_MOE, intermediate_size=256)).eval()
    expected = write_fp8(ref, tmp_path / "ct", rows, cols, compressed=True)
    got = dict(load_model(tmp_path / "ct", device="cpu").model.named_parameters())
    checked = 0
    for name, want in expected.items():
        if name in got and _quantized(name, want):
            assert torch.equal(got[name], want), name
            checked += 1
    assert checked >= 2 * TINY_BASE["num_hidden_layers"]


@pytest.mark.parametrize("edit, message", [
    (lambda g: g["weights"].update(num_bits=4, type="int"), "4-bit int weights .* are not supported"),
    (lambda g: g.update(format="pack-quantized"), r"\(pack-quantized\) are not supported"),
    (lambda g: g["weights"].update(strategy="group", group_size=128), "strategy 'group' is not supported"),
    (lambda g: g["weights"].update(block_structure=[128]), "block_structure must be two positive integers"),
])
def test_compressed_tensors_other_than_8_bit_floats_are_refused_by_name(tmp_path, edit, message) -> None:
    torch.manual_seed(2)
    ref = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**TINY_BASE, **TINY_GDN, intermediate_size=256)).eval()
    write_fp8(ref, tmp_path / "ct", 32, 48, compressed=True)
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())
    edit(cfg["quantization_config"]["config_groups"]["group_0"])
    (tmp_path / "ct" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path / "ct", device="cpu")


def test_edge_cases_of_fp8_builds_found_in_review(qwen3_next_fp8, tmp_path) -> None:
    """(a) a tied model whose FP8 build also stores an 8-bit head (read as the embeddings, as any tied
    head); (b) a missing projection named once, not with hypic's own row scales beside it; (c) a
    compressed-tensors config for the KV cache alone (weights as they are, its k/v scales read past);
    (d) an input scale in a checkpoint whose config declares no quantization, named as such."""
    torch.manual_seed(0)
    ref = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**TINY_BASE, **TINY_GDN, intermediate_size=256,
                                                   tie_word_embeddings=True)).eval()
    write_fp8(ref, tmp_path / "tied", 32, 48)
    _edit_files(tmp_path / "tied", lambda w, s: (w.__setitem__("lm_head.weight", quantize_blocks(
        w["model.embed_tokens.weight"], 32, 48)[0]), s.__setitem__("lm_head.weight_scale_inv", torch.ones(16, 3))))
    assert load_model(tmp_path / "tied", device="cpu").model.tie_embeddings

    missing = _edit(qwen3_next_fp8[1], tmp_path / "missing", shard=(WEIGHTS, lambda t: t.pop(WEIGHT)))
    with pytest.raises(ValueError,
                       match=r"lacks 1 tensors, e\.g\. \['model\.layers\.0\.linear_attn\.out_proj\.weight'\]"):
        load_model(missing, device="cpu", quantization="fp8")

    kv_only = _edit(qwen3_next_fp8[3], tmp_path / "kv",
                    lambda c: c.__setitem__("quantization_config", {
                        "quant_method": "compressed-tensors", "config_groups": {}, "format": "dense",
                        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}),
                    ("model.safetensors", lambda t: t.__setitem__("model.layers.3.self_attn.k_scale",
                                                                  torch.tensor(1.0))))
    plain = load_model(qwen3_next_fp8[3], device="cpu")
    loaded = load_model(kv_only, device="cpu")
    assert loaded.quantization is None
    from hypic.models.quantized import resolved_quantization  # nor on a GPU: no weight is 8-bit

    kv_config = json.loads((kv_only / "config.json").read_text())
    assert resolved_quantization("auto", kv_config, torch.device("cuda")) is None
    ids = torch.arange(3, 30)
    assert torch.equal(hypic_logits(loaded, ids), hypic_logits(plain, ids))

    static = _edit(qwen3_next_fp8[3], tmp_path / "static", None,
                   ("model.safetensors", lambda t: t.__setitem__(WEIGHT[:-len("weight")] + "input_scale",
                                                                 torch.tensor(0.5))))
    with pytest.raises(ValueError, match="input_scale' is a quantization scale, but config.json declares no"):
        load_model(static, device="cpu")


def _edit_files(path, edit) -> None:
    """``edit(weights, scales)`` over the two shards write_fp8 made, the index rewritten to match."""
    w, s = load_file(path / WEIGHTS), load_file(path / SCALES)
    edit(w, s)
    save_file(w, path / WEIGHTS, metadata={"format": "pt"})
    save_file(s, path / SCALES, metadata={"format": "pt"})
    index = {n: WEIGHTS for n in w} | {n: SCALES for n in s}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
