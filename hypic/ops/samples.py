"""Random inputs for every linear-attention family: the ops tests and the algebra self-check
(``hypic demo`` without a model) draw the same kind of spans."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hypic.ops.family import get_family


def family_inputs(family: str, length: int, *, heads: int = 2, value_heads: int = 2, key_dim: int = 8,
                  value_dim: int = 4, dtype: torch.dtype = torch.float64, device: str = "cpu",
                  seed: int = 0, decay: float = 0.2) -> dict[str, torch.Tensor]:
    """q, k (l2-normalised, as the model layers feed them), v and the family's gates."""
    gen = torch.Generator(device=device).manual_seed(seed)
    fam = get_family(family)
    L, H, HV, K, V = length, heads, value_heads, key_dim, value_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, device=device, dtype=torch.float64)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float64)

    out = {"q": randn(L, H, K), "k": F.normalize(randn(L, H, K), dim=-1), "v": randn(L, HV, V)}
    if fam.gate == "head":
        out["g"] = -decay * rand(L, HV)
    elif fam.gate == "key":
        out["g"] = -decay * rand(L, HV, K)
    if fam.beta:
        out["beta"] = rand(L, HV)
    if fam.lowrank:  # RWKV-7-like: a = −κ, b = κ·α keeps the transition contractive
        kappa = F.normalize(randn(L, HV, K), dim=-1)
        out["a"], out["b"] = -kappa, kappa * rand(L, HV, 1)
    return {n: x.to(dtype) for n, x in out.items()}


def token_kwargs(x: dict[str, torch.Tensor], sl: slice | None = None) -> dict[str, torch.Tensor]:
    """The gate arguments (g, beta, a, b) of an input dict, optionally sliced in time."""
    return {n: (t if sl is None else t[sl]) for n, t in x.items() if n in ("g", "beta", "a", "b")}
