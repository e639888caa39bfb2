"""Architecture name → how to build the model and map checkpoint tensor names onto it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypic.models import qwen3_5
from hypic.models.hybrid import HybridLM


@dataclass(frozen=True)
class Architecture:
    build: Callable[[dict[str, Any]], HybridLM]
    checkpoint_name: Callable[[str], str | None]


ARCHITECTURES: dict[str, Architecture] = {
    "Qwen3_5ForCausalLM": Architecture(qwen3_5.build_qwen3_5, qwen3_5.checkpoint_name),
    "Qwen3_5ForConditionalGeneration": Architecture(qwen3_5.build_qwen3_5, qwen3_5.checkpoint_name),
}
MODEL_TYPES: dict[str, str] = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM"}


def resolve(config: dict[str, Any]) -> Architecture:
    names = list(config.get("architectures") or [])
    if config.get("model_type") in MODEL_TYPES:
        names.append(MODEL_TYPES[config["model_type"]])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(f"config.json: unknown architecture {names or config.get('model_type')!r}; "
                     f"hypic supports {sorted(ARCHITECTURES)}")
