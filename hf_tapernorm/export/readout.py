"""Whether a model's readout is affine: the logits a linear map of the residual stream plus one constant.

This is the interpretability payoff of folding the final norm. Through a real final norm the logits depend on
each token's scale, so the direct effect of one part of the residual stream (an attention or MLP output)
on a logit is not its attribution; with the final norm folded into ``lm_head`` (``scope="all"``) the readout
is affine, direct logit attribution is exact and the parts add up to the logit (docs/interpretability.md).

:func:`readout_summary` says it from what an export's config records; :func:`readout_additivity_error`
measures it on real hidden states, for any causal LM: the readout R (final norm, then head) of two parts of
the stream, less the constant R(0), against R of their sum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn
from torch.func import functional_call

from ..architectures.sites import norm_sites
from ..errors import ConfigurationError, UnsupportedModelError


def final_norm_path(model: nn.Module) -> Optional[str]:
    """The path of ``model``'s final norm (relative to the ``*ForCausalLM`` model), or None without one.

    A folded export records it in its config (the module may be an identity now); any other model is read
    from the architecture table or discovery. A layout the table refuses to taper (post-LN OPT, whose last norm is
    inside its last block, or an OPT without a final norm) has none to read through: None, so that evaluating such
    a base model, which folds nothing, is not refused as taper is."""
    recorded = getattr(model.config, "final_norm", None)
    if recorded:
        return recorded
    try:
        sites = norm_sites(model)
    except (ConfigurationError, UnsupportedModelError):
        return None
    return next((site.path for site in sites if site.is_final), None)


def readout_summary(config: Any) -> dict[str, Any]:
    """What an export's config says of its readout: ``affine`` (the final norm folded into the head, or kept as
    one explicit per-channel scale) and how the final norm was treated, beside the folded and kept norm counts."""
    final = getattr(config, "final_norm", "")
    folded, scaled = list(getattr(config, "folded_norms", [])), list(getattr(config, "scaled_norms", []))
    kept, weightless = list(getattr(config, "kept_norms", [])), dict(getattr(config, "weightless_norms", {}) or {})
    if final and final in folded:
        how = "folded into lm_head"
    elif final and final in scaled:
        how = "an explicit per-channel scale (tied head kept)"
    elif final in weightless:
        how = "kept as a real norm, its weight folded into lm_head"
    else:
        how = "kept as a real norm"
    return {
        "affine": bool(final) and (final in folded or final in scaled),
        "final_norm": how,
        "folded_norms": len(folded),
        "kept_norms": len(kept),
    }


def _projection_after_the_final_norm(model: nn.Module) -> Optional[nn.Module]:
    """The linear map between the final norm and the head, where the model has one (OPT's ``project_out``, when its
    ``word_embed_proj_dim`` is not its hidden size): part of the readout, which is affine through it too."""
    return next((m for name, m in model.named_modules() if name.rpartition(".")[2] == "project_out"), None)


@torch.no_grad()
def readout_additivity_error(model: nn.Module, input_ids: torch.Tensor, *, seed: int = 0) -> Optional[float]:
    """max |R(a) + R(b) - R(0) - R(a + b)| / max |R(a + b)| over the text positions of ``input_ids``, where a + b is
    the residual stream entering the final norm, split at random channel by channel, and R is the final norm
    followed by the head. About float32 precision for an affine readout; of the order of the logits through a
    real norm. None for a model without a final norm this package can find, or without a text position.

    R runs in float32 (the stream, and the norm's and head's weights, upcast) whatever the model's dtype: being
    affine is a property of the readout's structure, and bf16 rounding of four readouts would otherwise pass for
    a non-linearity. Sink positions (the leading sink of a model patched or folded with one, when the input
    starts with it) are left out: TaperNorm keeps them normalized and an export stores their logits as
    constants, so the readout of the text is what folding makes affine.
    """
    path = final_norm_path(model)
    head = model.get_output_embeddings()
    if path is None or head is None:
        return None
    norm = model.get_submodule(path)
    captured: list[torch.Tensor] = []
    handle = norm.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    try:
        model(input_ids=input_ids)
    finally:
        handle.remove()
    if not captured:
        return None
    stream = captured[-1].float()
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.rand(stream.shape, generator=generator) < 0.5).to(stream)
    part_a, part_b = stream * mask, stream * (1 - mask)
    norm_fp32, head_fp32 = _in_float32(norm), _in_float32(head)
    projection = _projection_after_the_final_norm(model)
    project = _in_float32(projection) if projection is not None else nn.Identity()
    sink = _sink_positions(model, input_ids, stream)

    def readout(hidden: torch.Tensor) -> torch.Tensor:
        # The whole stream each time (a TaperNorm picks its sink positions by column), the sink's columns dropped after.
        return head_fp32(project(norm_fp32(hidden)))[..., sink:, :]

    whole = readout(stream)
    if whole.numel() == 0:
        return None
    summed = readout(part_a) + readout(part_b) - readout(torch.zeros_like(stream))
    return float((summed - whole).abs().max() / whole.abs().max().clamp_min(1e-30))


def _in_float32(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s forward with its floating-point parameters and buffers in float32 (the module is left as it is)."""
    state = {
        name: tensor.float() if tensor.is_floating_point() else tensor
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
    }
    return lambda hidden: functional_call(module, state, (hidden,))


def _sink_positions(model: nn.Module, input_ids: torch.Tensor, stream: torch.Tensor) -> int:
    """How many leading positions of ``stream`` are the model's sink: its sink tokens (a patched model's TaperNorm
    config, else an export's config) when every row of ``input_ids`` starts with them and the stream has a column
    per input column (an export drops the sink from its input, so its stream holds the text alone)."""
    taper_config = getattr(model, "tapernorm_config", None)
    ids = getattr(taper_config, "sink_token_ids", None) if taper_config is not None else None
    ids = list(ids if ids is not None else getattr(model.config, "sink_token_ids", None) or [])
    n = len(ids)
    if not n or input_ids.shape[-1] < n or stream.shape[-2] != input_ids.shape[-1]:
        return 0
    starts = input_ids[..., :n].eq(torch.tensor(ids, device=input_ids.device)).all(-1)
    return n if bool(starts.all()) else 0


#: The largest additivity error, relative to the largest logit, that counts as an affine readout: far above float32
#: rounding (what an affine readout measures, in any dtype), far below what a real norm gives.
AFFINE_TOLERANCE = 1e-3


def readout_facts(model: nn.Module, input_ids: torch.Tensor) -> dict[str, Any]:
    """What ``hf-tapernorm eval`` reports of a model's readout, measured on ``input_ids`` (one block of real text):
    ``affine`` (the additivity error at most AFFINE_TOLERANCE), the error, and for an export what its config
    says of its final norm."""
    error = readout_additivity_error(model, input_ids) if len(input_ids) else None
    facts = readout_summary(model.config) if getattr(model.config, "final_norm", None) else {}
    return {**facts, "affine": error is not None and error <= AFFINE_TOLERANCE, "additivity_error": error}


__all__ = ["AFFINE_TOLERANCE", "final_norm_path", "readout_additivity_error", "readout_facts", "readout_summary"]
