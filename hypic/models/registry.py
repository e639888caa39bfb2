"""Architecture name → how to build the model and map checkpoint tensor names onto it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypic.models import kimi_linear, minimax, qwen3_5, qwen3_next, ring_linear
from hypic.models.hybrid import HybridLM


@dataclass(frozen=True)
class Architecture:
    build: Callable[[dict[str, Any]], HybridLM]
    checkpoint_name: Callable[[str], str | None]


ARCHITECTURES: dict[str, Architecture] = {
    "BailingMoeLinearV2ForCausalLM": Architecture(ring_linear.build_ring_linear, ring_linear.checkpoint_name),
    "KimiLinearForCausalLM": Architecture(kimi_linear.build_kimi_linear, kimi_linear.checkpoint_name),
    "MiniMaxForCausalLM": Architecture(minimax.build_minimax, minimax.checkpoint_name),
    "MiniMaxText01ForCausalLM": Architecture(minimax.build_minimax, minimax.checkpoint_name),
    "MiniMaxM1ForCausalLM": Architecture(minimax.build_minimax, minimax.checkpoint_name),
    "Qwen3_5ForCausalLM": Architecture(qwen3_5.build_qwen3_5, qwen3_5.checkpoint_name),
    "Qwen3_5ForConditionalGeneration": Architecture(qwen3_5.build_qwen3_5, qwen3_5.checkpoint_name),
    "Qwen3NextForCausalLM": Architecture(qwen3_next.build_qwen3_next, qwen3_5.checkpoint_name),
    "Qwen3_5MoeForCausalLM": Architecture(qwen3_next.build_qwen3_5_moe, qwen3_5.checkpoint_name),
    "Qwen3_5MoeForConditionalGeneration": Architecture(qwen3_next.build_qwen3_5_moe, qwen3_5.checkpoint_name),
}
MODEL_TYPES: dict[str, str] = {
    "bailing_moe_linear": "BailingMoeLinearV2ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "minimax": "MiniMaxForCausalLM",
    "minimax_text_01": "MiniMaxText01ForCausalLM",
    "minimax_m1": "MiniMaxM1ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}


def resolve(config: dict[str, Any]) -> Architecture:
    names = config.get("architectures") or []
    names = [names] if isinstance(names, str) else list(names) if isinstance(names, list) else []
    if isinstance(config.get("model_type"), str) and config["model_type"] in MODEL_TYPES:
        names.append(MODEL_TYPES[config["model_type"]])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(f"config.json: unknown architecture {names or config.get('model_type')!r}; "
                     f"hypic supports {sorted(ARCHITECTURES)}")
