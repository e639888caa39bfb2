"""What a worker process needs to build the engine's model on its own device.

Weights never cross the process boundary: a worker loads the same checkpoint folder, or rebuilds
the same random-weight model from its config and seed (benchmarks at real shapes). Its weight
fingerprint is then checked against the engine's, so a worker whose weights differ (another
checkpoint on disk, a different random stream) is refused rather than silently producing entries
of another model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hypic.models.loader import LoadedModel, load_model


@dataclass(frozen=True)
class ModelSpec:
    path: str | None  # a local model folder, or None for a random-weight model
    config: dict[str, Any] | None  # the random-weight model's config
    seed: int
    dtype: str
    quantization: str | None = None

    @classmethod
    def of(cls, loaded: LoadedModel) -> ModelSpec:
        dtype = str(loaded.dtype).removeprefix("torch.")
        name = str(loaded.path)
        if name.startswith("random:"):  # hypic.models.random_init names its models so
            return cls(None, loaded.config, int(name.removeprefix("random:")), dtype, loaded.quantization)
        return cls(str(loaded.path), None, 0, dtype, loaded.quantization)

    def build(self, device: torch.device) -> LoadedModel:
        if self.path is not None:
            return load_model(self.path, device=device, dtype=self.dtype, quantization=self.quantization)
        from hypic.models.random_init import random_model

        return random_model(self.config or {}, device=device, dtype=getattr(torch, self.dtype), seed=self.seed,
                            quantization=self.quantization)

