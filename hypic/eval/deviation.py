"""Where each mode's error lives, layer by layer, against ``full`` on the same prompts.

Two measures per label of the ladder (``hypic.eval.quality.LABELS``):

- the **residual stream** of the last prompt token after every layer — the hidden state the first
  answer token is read from — as ``‖h − h_full‖ / ‖h_full‖``;
- every **linear layer's state** after the prompt (what decoding starts from), as
  ``‖S − S_full‖_F / ‖S_full‖_F``.

Scores say how much a mode loses; this says where. The first linear layer sees only token
embeddings, so there hypic's composed state (exact ``T``, conv warm-up, seams of ``w ≥ W − 1``) is
the true one to rounding, while ``naive`` and ``transition`` (no warm-up) are not; from the second
layer on, every cached mode carries what a document's standalone prefill did not see (its lower
layers ran from zero state). docs/quality.md has the bundled model's tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams
from hypic.eval.quality import LABELS, build_entries, check_labels, task_prompts
from hypic.models.loader import LoadedModel

DEFAULT_LABELS = ("full", "prefix", "zero_state", "naive", "addition", "transition", "hypic_w0", "hypic_w8")


@dataclass
class Deviation:
    residual: list[float] = field(default_factory=list)  # per layer: mean relative error, last prompt token
    state: dict[int, float] = field(default_factory=dict)  # per linear layer: mean relative error after the prompt


class ResidualProbe:
    """Records, while ``recording``, every layer's output at the rows the model is asked logits for
    (``HybridLM.forward(ids, ctx, rows)``): one ``[rows, layers, hidden]`` tensor per call, in order.
    Forwards without rows (a standalone prefill run through ``hidden_states``) are not recorded."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.recording = False
        self.calls: list[Tensor] = []
        self._rows: Tensor | None = None
        self._layers: list[Tensor] = []
        self._handles = [model.register_forward_pre_hook(self._begin, with_kwargs=True),
                         model.register_forward_hook(self._end)]
        self._handles += [layer.register_forward_hook(self._layer) for layer in model.model.layers]

    def _begin(self, module, args, kwargs) -> None:
        rows = args[2] if len(args) > 2 else kwargs.get("rows")
        self._rows = rows if self.recording else None
        self._layers = []

    def _layer(self, module, args, out: Tensor) -> None:
        if self._rows is not None:
            self._layers.append(out[self._rows].float())

    def _end(self, module, args, out) -> None:
        if self._rows is not None:
            self.calls.append(torch.stack(self._layers, 1))
        self._rows = None

    def take(self) -> Tensor:
        out, self.calls = torch.cat(self.calls), []
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _relative(x: Tensor, ref: Tensor, start: int) -> Tensor:
    """‖x − ref‖ / ‖ref‖ over every dimension from ``start`` on (Frobenius for states)."""
    return (x - ref).flatten(start).norm(dim=-1) / ref.flatten(start).norm(dim=-1).clamp_min(1e-30)


def measure(loaded: LoadedModel, *, n: int, seed: int = 1234, difficulty: float = 1.0,
            labels: list[str] | None = None, batch: int = 8) -> dict[str, Deviation]:
    """Mean relative deviation from ``full`` per layer, for each label, over ``n`` prompts per family."""
    labels = check_labels(labels or list(DEFAULT_LABELS))
    if n < 1:
        raise ValueError(f"n: expected at least one example per family, got {n}")
    prompts = [e.segments for encoded in task_prompts(loaded, n, seed, difficulty)[1].values() for e in encoded]
    chunks = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    linear_layers = loaded.model.kinds.linear_layers
    probe = ResidualProbe(loaded.model)

    def run(label: str) -> tuple[Tensor, Tensor]:
        """Every prompt's last-token residuals [N, layers, hidden] and linear states [N, linear layers, …]."""
        mode, seam, cold = LABELS[label]
        engine = Engine(loaded, seam=seam, cold=cold)
        residuals, states = [], []
        for chunk in chunks:
            probe.recording = False  # an in-context label's pre-pass is not measured
            build_entries(engine, chunk, mode, cold)
            probe.recording = True
            runs = engine.start(chunk, [SamplingParams(max_tokens=1)] * len(chunk), mode=mode)
            probe.recording = False
            residuals.append(probe.take())
            states.append(torch.stack([torch.stack([r.state.linear[i].float() for i in linear_layers])
                                       for r in runs]))
        return torch.cat(residuals), torch.cat(states)

    try:
        ref_h, ref_s = run("full")
        out: dict[str, Deviation] = {}
        for label in labels:
            h, s = (ref_h, ref_s) if label == "full" else run(label)
            res_err = _relative(h, ref_h, 2).mean(0)  # [layers]
            state_err = _relative(s, ref_s, 2).mean(0)  # [linear layers]
            out[label] = Deviation([round(v, 8) for v in res_err.tolist()],
                                   {i: round(v, 8) for i, v in zip(linear_layers, state_err.tolist(), strict=True)})
        return out
    finally:
        probe.close()


def tables(results: dict[str, Deviation], kinds: tuple[str, ...]) -> str:
    """Two markdown tables, one row per label: the residual's deviation after every layer (headed
    by the layer's mixer), then every linear layer's state."""
    if not results:
        return ""
    first = next(iter(results.values()))
    heads = [f"{i} {kinds[i]}" for i in range(len(first.residual))]
    out = ["Residual stream at the last prompt token, ‖h − h_full‖ / ‖h_full‖ after each layer:", "",
           "| mode | " + " | ".join(heads) + " |", "|" + "---|" * (len(heads) + 1)]
    out += [f"| {label} | " + " | ".join(f"{v:.2e}" for v in r.residual) + " |" for label, r in results.items()]
    layers = list(first.state)
    out += ["", "Linear state after the prompt, ‖S − S_full‖_F / ‖S_full‖_F per linear layer:", "",
            "| mode | " + " | ".join(f"layer {i}" for i in layers) + " |", "|" + "---|" * (len(layers) + 1)]
    out += [f"| {label} | " + " | ".join(f"{r.state[i]:.2e}" for i in layers) + " |" for label, r in results.items()]
    return "\n".join(out)
