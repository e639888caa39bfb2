"""The decoder stack every family shares: embeddings, residual layers whose mixer is linear
attention or full attention, a final norm and the LM head.

Residuals are pre-norm (``x + f(norm(x))``) unless a family gives a ``Residual``: MiniMax adds the
*normed* input, each term scaled (``norm(x)·α + f(norm(x))·β``).

Parameter names follow the Hugging Face checkpoints (``model.layers.{i}.linear_attn...``,
``...self_attn...``, ``...mlp...``) so weights load by name; a family supplies the mixer, the FFN
and the norm for each layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hypic.models.context import ForwardContext


@dataclass(frozen=True)
class LayerKinds:
    """Which mixer each layer has: 'linear' (a linear-attention family) or 'attention'."""

    kinds: tuple[str, ...]
    linear_family: str  # the ops family of the linear layers (gdn, kda, scalar, ...)

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "linear"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "attention"]


@dataclass(frozen=True)
class Residual:
    """How a layer's two blocks add to the stream: ``base·alpha + block·beta``, the base being the
    block's normed input when ``normed`` (MiniMax's ``postnorm``), else its raw input."""

    mixer_alpha: float = 1.0
    mixer_beta: float = 1.0
    mlp_alpha: float = 1.0
    mlp_beta: float = 1.0
    normed: bool = False


class DecoderLayer(nn.Module):
    def __init__(self, mixer_name: str, mixer: nn.Module, mlp: nn.Module, norm: Callable[[], nn.Module],
                 residual: Residual | None = None) -> None:
        super().__init__()
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.residual = residual

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        r = self.residual
        if r is None:
            x = x + getattr(self, self.mixer_name)(self.input_layernorm(x), ctx)
            return x + self.mlp(self.post_attention_layernorm(x))
        h = self.input_layernorm(x)
        x = (h if r.normed else x) * r.mixer_alpha + getattr(self, self.mixer_name)(h, ctx) * r.mixer_beta
        h = self.post_attention_layernorm(x)
        return (h if r.normed else x) * r.mlp_alpha + self.mlp(h) * r.mlp_beta


class Backbone(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: list[DecoderLayer], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class HybridLM(nn.Module):
    """A hybrid causal LM: ``forward(input_ids [T], ctx, rows) -> logits [len(rows), vocab]``."""

    def __init__(self, backbone: Backbone, vocab: int, hidden: int, kinds: LayerKinds, *, tie_embeddings: bool,
                 max_positions: int) -> None:
        super().__init__()
        self.model = backbone
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.kinds, self.tie_embeddings, self.max_positions = kinds, tie_embeddings, max_positions
        self.vocab_size = vocab
        if tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def cast(self, dtype: torch.dtype) -> HybridLM:
        """Every parameter in ``dtype`` but those a module names in its ``KEEP_FP32`` (a router's
        weights, KDA's dt_bias), which stay fp32. Meant on the meta device, before ``to_empty``."""
        self.to(dtype)
        for module in self.modules():
            for name in getattr(module, "KEEP_FP32", ()):
                p = getattr(module, name, None)
                if isinstance(p, nn.Parameter):
                    p.data = p.data.float()
        return self

    def hidden_states(self, input_ids: Tensor, ctx: ForwardContext) -> Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, ctx)
        return self.model.norm(x)

    def forward(self, input_ids: Tensor, ctx: ForwardContext, rows: Tensor | None = None) -> Tensor:
        """Logits of the tokens at ``rows`` (all tokens when None), in fp32."""
        h = self.hidden_states(input_ids, ctx)
        if rows is not None:
            h = h[rows]
        return self.lm_head(h).float()

    @torch.no_grad()
    def last_token_rows(self, cu_seqlens: Tensor) -> Tensor:
        return (cu_seqlens[1:] - 1).clamp_min(0)
