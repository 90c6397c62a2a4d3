"""Which norms a pretrained model can lose: a rule per site role, from how its consumer grows with a token's scale.

Once a norm is a fixed linear map, what it feeds sees each token at its own scale k (relative to the
typical token) instead of at scale 1. A consumer whose contribution to the residual stream grows faster
than k makes the fixed point k = 1 unstable as the gate falls, and above-typical tokens run away layer
after layer (docs/method.md, section 7; the evidence is in docs/fidelity.md):

- a **gated MLP** (SwiGLU/GeGLU) multiplies two projections of its input: degree 2. Its input norm stays
  (or, where it has none, as in OLMo2, the norm on its output that bounds it);
- **q/k norms** (Qwen3, Gemma 3, OLMo2, Phi with qk_layernorm): with the norm in front of attention
  linear too, a logit grows like k_query * k_key, and one scalar c per layer cannot fit per-head scales
  that the model learned to normalize away. They stay;
- attention's own update is a mix of other positions' values (degree 0-1 in k), a plain (GELU) MLP is
  degree 1, and a norm on a branch output whose input is already normalized is degree 0: those taper,
  except in a gated-MLP model the attention input norms of the layers where a runaway starts
  (RUNAWAY_BAND of the depth). Once their residual has grown, a linear attention input lets a grown token
  outbid the sink for attention, which mixes content into every position and grows the residual further;
  on SmolLM2 (layers 4-13 of 30) keeping them removed every broken window measured (docs/fidelity.md).

The rules read only the architecture table's roles (or discovery's), so they apply to every family.
"""

from __future__ import annotations

from torch import nn

from .sites import architecture_of, norm_sites

GATED_MLP_INPUT = (
    "feeds a gated (SwiGLU/GeGLU) MLP, whose output grows with the square of a token's scale once the norm is linear"
)
QK_NORM = (
    "a query/key norm: with the attention input linear too, a logit grows like k_query * k_key, and one c per layer "
    "cannot fit per-head scales"
)
RUNAWAY_LAYER = (
    "feeds attention in a layer where a grown residual starts to outbid the sink for attention (RUNAWAY_BAND)"
)
#: The layers (as fractions of the depth, by each layer's centre) whose attention input norms a gated-MLP
#: model keeps: 4-13 of SmolLM2's 30 layers, where a broken window's residual starts to grow.
RUNAWAY_BAND = (0.13, 0.47)
GATED_MLP_OUTPUT = (
    "the only norm bounding a gated MLP that has no input norm (its output grows with the square of the token's scale)"
)


def norms_to_keep(model: nn.Module) -> dict[str, str]:
    """``{qualified name: reason}`` of the internal norms a pretrained ``model`` should keep as real norms."""
    arch = architecture_of(model)
    sites = [site for site in norm_sites(model, arch) if not site.is_final]
    has_mlp_input = {site.layer for site in sites if site.role in ("mlp", "attention_mlp")}
    depth = len({site.layer for site in sites})
    keep = {}
    for site in sites:
        if arch.gated_mlp and site.role in ("mlp", "attention_mlp"):
            keep[site.path] = GATED_MLP_INPUT
        elif site.role == "qk":
            keep[site.path] = QK_NORM
        elif arch.gated_mlp and site.role == "mlp_output" and site.layer not in has_mlp_input:
            keep[site.path] = GATED_MLP_OUTPUT
        elif arch.gated_mlp and site.role == "attention" and in_runaway_band(site.layer, depth):
            keep[site.path] = RUNAWAY_LAYER
    return keep


def in_runaway_band(layer: int, depth: int) -> bool:
    """Whether decoder layer ``layer`` (0-based) of ``depth`` lies in RUNAWAY_BAND, by its centre."""
    low, high = RUNAWAY_BAND
    return low <= (layer + 0.5) / depth < high


def norms_feeding_gated_mlps(model: nn.Module) -> list[str]:
    """Qualified names of the internal norms whose output feeds a gated MLP (empty without one)."""
    return [path for path, reason in norms_to_keep(model).items() if reason == GATED_MLP_INPUT]


__all__ = ["RUNAWAY_BAND", "in_runaway_band", "norms_feeding_gated_mlps", "norms_to_keep"]
