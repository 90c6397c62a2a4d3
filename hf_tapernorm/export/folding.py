"""fold_model: turn a patched model at gate 0 into a norm-free model of a registered folded class.

At g = 0 every tapered norm is the fixed map h -> h A + beta with A = c D_gammat (RMS) or
A = c (I - 11^T/d) D_gammat (LayerNorm), and folds into the modules the architecture table says
read it (docs/method.md, section 5). The algebra is one routine per site kind, driven by the table:

- ``"input"`` (a pre-norm): the consumers' input columns, W' = W A, bias' = bias + W beta;
- ``"per_head"`` / ``"output"`` (a q/k norm or a post-norm on a branch output): the producers'
  output rows, repeated per group of ``d`` rows, W' = A^T W, bias' = A^T bias + beta.

A kept pre-norm's own weight folds the same way (FlashNorm, arXiv 2407.09577): its consumers absorb the
gain, W' = W diag(gain) (and, for a LayerNorm, b' = b + W beta), and the norm stays without weight.
``fold_model`` does it for the kept norms of an export whose weight is an operation of its own (the RMS
families); ``flashnorm_model`` does it for every pre-norm of an unpatched model, the peer the benchmark
measures an export against.

The algebra, in float64 on working copies of the projections (Conv1D included), is projections.py.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, Literal, Optional

import torch
from torch import nn
from transformers import PreTrainedModel

from .._version import __version__
from ..architectures.sites import architecture_of, model_type_of, norm_sites
from ..architectures.styles import NormStyle
from ..config import config_of
from ..errors import CalibrationError, ConfigurationError, TaperStateError, UnsupportedModelError
from ..layers.sink import sink_outputs, sink_token_ids_of
from ..layers.taper_norm import TaperNorm, normalized, tapered_norms
from ..training.distributed import sharding_engine
from .fold_check import FoldReport, check_fold, check_probe
from .folded_input import learned_positions
from .model_card import render_model_card
from .modeling_folded import PREFIX, folded_classes
from .projections import FoldState, WorkingProjection, fold_into, make_weightless, store_projections
from .registration import register_folded_classes

logger = logging.getLogger(__name__)

TiedHead = Literal["untie", "scale"]
TIED_HEAD_CHOICES = ("untie", "scale")


def _check_model(model: nn.Module, model_type: str, caller: str) -> None:
    """What ``fold_model`` and ``flashnorm_model`` both refuse: a sharded, folded, compiled or wrapped model."""
    if sharding_engine(model) is not None:
        raise TaperStateError(
            f"{type(model).__name__} is sharded ({sharding_engine(model)}): {caller} needs the gathered model, e.g. "
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) loaded into an unsharded "
            "copy, or `hf-tapernorm fold --checkpoint` on a sharded checkpoint (docs/distributed.md)"
        )
    if model_type.startswith(PREFIX):  # a loaded export (remote code too): its norms are gone already
        raise TaperStateError(
            f"{type(model).__name__} is already folded (a norm-free export): use it as it is; fold_model reads a "
            "patched model tapered to gate 0 (load_tapered(folder) for a tapered checkpoint), flashnorm_model an "
            "unpatched one"
        )
    base_class = folded_classes(model_type)[1].__bases__[-1]
    if hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule around the model
        raise UnsupportedModelError(
            f"{caller} expects a {base_class.__name__}, got torch.compile's {type(model).__name__}: pass the "
            f"module it wraps, {caller}(model._orig_mod)"
        )
    if not isinstance(model, base_class):
        peft = hasattr(model, "merge_and_unload")
        unmerged = f"; merge its PEFT adapters first: {caller}(model.merge_and_unload())" if peft else ""
        raise UnsupportedModelError(f"{caller} expects a {base_class.__name__}, got {type(model).__name__}{unmerged}")


def _check_foldable(model: nn.Module, model_type: str) -> None:
    _check_model(model, model_type, "fold_model")
    if not any(tapered_norms(model, include_kept=True)):
        raise TaperStateError(
            f"{type(model).__name__} is not patched: fold_model needs a model patched with patch_model, "
            "calibrated and tapered to gate 0 (flashnorm_model folds the norm weights of an unpatched model)"
        )
    layers = list(tapered_norms(model))
    uncalibrated = [name for name, layer in layers if not layer.is_calibrated]
    if uncalibrated:
        raise CalibrationError(
            f"cannot fold: {len(uncalibrated)} tapered layer(s) are uncalibrated ({', '.join(uncalibrated)}); "
            "calibrate(model) and taper the gate to 0 first"
        )
    open_gates = [f"{name} (gate {float(layer.gate):.4g})" for name, layer in layers if float(layer.gate) > 0.0]
    if open_gates:
        raise TaperStateError(
            f"cannot fold: {len(open_gates)} tapered layer(s) have a gate above 0: {', '.join(open_gates)}; "
            "only a model at g = 0 is a fixed linear map "
            "(set_gate(model, 0.0) or finish the taper schedule)"
        )


def _linear_map(layer: TaperNorm) -> tuple[torch.Tensor, Optional[torch.Tensor], bool]:
    """(scale = c * gammat, beta or None when absent/zero, centred) of a TaperNorm at g = 0, in float64."""
    scale = layer.c.detach().to(torch.float64) * layer.taper_weight.detach().to(torch.float64)
    centred = layer.style is NormStyle.LAYER
    beta = None
    if centred and layer.bias is not None and bool(layer.bias.detach().ne(0).any()):
        beta = layer.bias.detach().to(torch.float64)
    return scale, beta, centred


def _is_tied(model: PreTrainedModel, arch) -> bool:
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embeddings is not None and head.weight is embeddings.weight
    return tied and model.get_submodule(arch.lm_head) is head  # OPT's project_out reads the final norm, not the head


def _keep_final_scale(fold: FoldState, path: str, layer: TaperNorm, scale, beta, centred: bool) -> None:
    """tied_head="scale": the final norm stays as one explicit per-channel map, so the tie survives."""
    fold.scaled_norms.append(path)
    fold.state[f"{path}.weight"] = scale.to(layer.taper_weight.dtype)
    if centred:
        shift = beta if beta is not None else torch.zeros_like(scale)
        fold.state[f"{path}.bias"] = shift.to(layer.taper_weight.dtype)
    logger.warning(
        "tapered final norm %s meets tied embeddings: kept as one explicit per-channel scale so the "
        "tie survives (tied_head='scale')",
        path,
    )


def _untie_warning(path: str, what: str, advice: str = "pass tied_head='scale' to keep the tie") -> None:
    logger.warning(
        "%s final norm %s folds into a tied lm_head: the head is untied and saved with tie_word_embeddings=False (%s)",
        what,
        path,
        advice,
    )


def _weight_is_an_operation(site, layer: TaperNorm) -> bool:
    """Whether a kept norm's weight can leave it and save an operation: a pre-norm (its consumers read it
    linearly) of the RMS families. A LayerNorm applies its affine in the same kernel, so moving it saves
    nothing and could add a bias; a q/k norm or a post-norm has RoPE or the residual sum after it."""
    return site.kind == "input" and layer.style is not NormStyle.LAYER and layer.weight is not None


def _meets_tied_head(site, layer: TaperNorm, tied: bool) -> bool:
    """Whether folding ``layer`` changes a tied head: the final norm, tapered or with a weight that leaves it."""
    return site.is_final and tied and (layer.tapered or _weight_is_an_operation(site, layer))


def unties_head(model: PreTrainedModel, tied_head: TiedHead = "untie") -> bool:
    """Whether ``fold_model(model, tied_head=tied_head)`` gives a tied lm_head weights of its own (one matrix more
    in the export). It reads the patched model's structure only, so a weightless (meta-device) copy answers: the
    disk an export needs is known before the weights load (``hf-tapernorm fold``)."""
    return tied_head == "untie" and tied_head_unused(model) is None


def tied_head_unused(model: PreTrainedModel) -> Optional[str]:
    """Why ``tied_head`` changes nothing in the fold of the patched ``model`` (None where it does): the choice is
    made only where the final norm's fold would change a tied lm_head. Like :func:`unties_head` it reads the
    structure only, so a weightless copy answers and ``hf-tapernorm fold --tied_head scale`` is refused before
    the weights load rather than writing the default export without a word."""
    arch = architecture_of(model)
    if not _is_tied(model, arch):
        return (
            "its final norm feeds no tied lm_head (tie_word_embeddings is false, or a projection stands between them)"
        )
    layers = [(site, model.get_submodule(site.path)) for site in norm_sites(model, arch)]
    if any(isinstance(layer, TaperNorm) and _meets_tied_head(site, layer, True) for site, layer in layers):
        return None
    final = next((f" {site.path}" for site, _ in layers if site.is_final), "")
    return f"its final norm{final} is kept (tapernorm_config.json's scope or keep_norms), so the tied head is unchanged"


def _fold_sites(model: PreTrainedModel, sites, tied: bool, tied_head: TiedHead) -> FoldState:
    """Fold every tapered site into the projections that read it; make the kept pre-norms weightless where that
    saves an operation, keep the other kept norms as they are; apply the tied-head policy."""
    fold = FoldState(state=dict(model.state_dict()))
    working: dict[str, WorkingProjection] = {}
    for site in sites:
        layer = model.get_submodule(site.path)
        if not isinstance(layer, TaperNorm):
            raise TaperStateError(f"{site.path} is a {type(layer).__name__}, not a TaperNorm: patch the whole model")
        for key in [k for k in fold.state if k.startswith(site.path + ".")]:
            del fold.state[key]
        meets_tied_head = _meets_tied_head(site, layer, tied)
        fold.head_choice = tied_head if meets_tied_head else fold.head_choice
        if not layer.tapered:
            fold.kept_norms.append(site.path)
            if _weight_is_an_operation(site, layer) and not (meets_tied_head and tied_head == "scale"):
                if meets_tied_head:
                    _untie_warning(site.path, "kept (weightless)")
                make_weightless(model, fold, working, site, layer, layer.style)
                continue
            for name in ("weight", "bias"):
                if getattr(layer, name) is not None:
                    fold.state[f"{site.path}.{name}"] = getattr(layer, name).detach()
            continue
        scale, beta, centred = _linear_map(layer)
        if meets_tied_head:
            if tied_head == "scale":
                _keep_final_scale(fold, site.path, layer, scale, beta, centred)
                continue
            _untie_warning(site.path, "tapered")
        fold.folded_norms.append(site.path)
        fold_into(model, working, site, scale, beta, centred)
    store_projections(fold, working)
    return fold


def _padded_stack(entries: list[torch.Tensor]) -> torch.Tensor:
    """The hidden states as one ``[entries, n, widest]`` tensor, each zero-padded on the right to the widest.

    Their widths can differ: OPT with ``word_embed_proj_dim`` != ``hidden_size`` (facebook/opt-350m) returns its
    last hidden state after ``project_out``, narrower than the others. The export reads each entry back at the
    width of the hidden state it goes with (``folded_sink._restore_outputs``), so the padding is never returned.
    """
    widest = max(entry.shape[-1] for entry in entries)
    return torch.stack([nn.functional.pad(entry, (0, widest - entry.shape[-1])) for entry in entries])


@torch.no_grad()
def _sink_activations(model: PreTrainedModel, sink_ids: list[int]) -> dict[str, torch.Tensor]:
    """The sink's hidden states (``[entries, n, hidden]``, ``_padded_stack``) and attention rows
    (``[layers, heads, n, n]``): constants, as its keys and values are (its positions take the normalized branch at
    every gate and attend only to themselves), which the export returns in the sink's columns of an input that
    starts with it.

    One forward of the sink alone, every norm computed (``normalized``), in eager attention (the one that returns
    its weights; the model's own is restored). A model that returns no attention weights stores none (its export
    gives NaN rows there).
    """
    ids = torch.tensor([sink_ids], device=next(model.parameters()).device)
    previous = model.config._attn_implementation  # transformers exposes the setter only (set_attn_implementation)
    was_training = model.training
    try:
        model.eval().set_attn_implementation("eager")
        with normalized(model):
            output = model(input_ids=ids, output_hidden_states=True, output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
        model.train(was_training)
    stored = {"sink_hidden_states": _padded_stack([entry[0] for entry in output.hidden_states])}
    if output.attentions and all(weights is not None for weights in output.attentions):
        stored["sink_attentions"] = torch.stack([weights[0] for weights in output.attentions])
    return stored


def _store_sink(model: PreTrainedModel, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Put the sink's keys/values, logits, hidden states and attention rows in ``state``; returns the config fields
    that describe them."""
    names = ("logits", "hidden_states", "attentions")
    sink_ids = sink_token_ids_of(model)
    if not sink_ids:
        empty = {"sink_token_ids": [], "sink_cache_shape": [], "sink_max_positions": 0}
        return {**empty, **{f"sink_{name}_shape": [] for name in names}}
    state["sink_keys"], state["sink_values"], state["sink_logits"] = sink_outputs(model, sink_ids)
    state.update(_sink_activations(model, sink_ids))
    shape = list(state["sink_keys"].shape)
    logger.info(
        "stored the keys/values of %d sink token(s) %s as a prefix of %s",
        len(sink_ids),
        sink_ids,
        "x".join(map(str, shape)),
    )
    return {
        "sink_token_ids": sink_ids,
        "sink_cache_shape": shape,
        **{
            f"sink_{name}_shape": list(state[f"sink_{name}"].shape) if f"sink_{name}" in state else [] for name in names
        },
        "sink_max_positions": learned_positions(model),
    }


def _folded_config(model: PreTrainedModel, model_type: str, arch, sites, fold: FoldState, tapernorm_config: dict):
    """The folded config: the base config (less what does not carry over) plus what folding did, the sink (its
    tensors go into ``fold.state``) and the run's TaperNormConfig (``to_dict``; empty for a FlashNorm fold)."""
    config_class = folded_classes(model_type)[0]
    sink = _store_sink(model, fold.state)
    values = model.config.to_dict()
    # quantization_config: GGUF checkpoints are dequantized at load, and quantized weights are refused above.
    for key in ("model_type", "architectures", "auto_map", "transformers_version", "quantization_config"):
        values.pop(key, None)
    if fold.head_choice == "untie":
        values["tie_word_embeddings"] = False
    # A Trainer sets use_cache=False on the model it trains (gradient checkpointing): not a property of the model.
    values["use_cache"] = type(model.config)().use_cache
    return config_class(
        **values,
        base_model_type=model_type,
        final_norm=next(site.path for site in sites if site.is_final),
        folded_norms=fold.folded_norms,
        kept_norms=fold.kept_norms,
        weightless_norms=fold.weightless_norms,
        scaled_norms=fold.scaled_norms,
        added_biases=fold.added_biases,
        centred_norms=arch.style is NormStyle.LAYER,
        tied_head=fold.head_choice,
        **sink,
        hf_tapernorm_version=__version__,
        tapernorm_config=tapernorm_config,
    )


def _check_tolerance(caller: str, tolerance: Optional[float]) -> None:
    number = isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool)  # True would be 1.0: no check
    if tolerance is not None and not (number and 0 < tolerance < math.inf):
        raise ConfigurationError(f"{caller}: tolerance must be a positive finite number, got {tolerance!r}")


def _folded_model(model: PreTrainedModel, model_type: str, arch, sites, fold: FoldState, tapernorm_config: dict):
    """The folded model of ``fold``: its registered class, loaded strictly from the folded state dict, on the
    source's device and in its dtype, with its generation config and name."""
    config = _folded_config(model, model_type, arch, sites, fold, tapernorm_config)
    folded = (
        folded_classes(model_type)[1]
        .from_pretrained(
            None,
            config=config,
            state_dict=fold.state,
            dtype=model.dtype,
            attn_implementation=model.config._attn_implementation,
        )
        .to(next(model.parameters()).device)
    )
    folded.generation_config = copy.deepcopy(model.generation_config)
    folded.config.name_or_path = model.config.name_or_path
    logger.info(
        "folded %d norm(s) of %s into %d projection(s); kept %d norm(s), %d of them weightless%s",
        len(fold.folded_norms),
        model_type,
        fold.projections,
        len(fold.kept_norms),
        len(fold.weightless_norms),
        f"; added a bias to {', '.join(fold.added_biases)}" if fold.added_biases else "",
    )
    return folded


def _fold_report(model, folded, check: bool, probe, tolerance, refold) -> Optional[FoldReport]:
    if not check:
        return None
    report = check_fold(model, folded, probe=probe, tolerance=tolerance, refold=refold)
    logger.info("fold check: max abs logit diff %.3g, max relative %.3g", report.max_abs_diff, report.max_rel_diff)
    return report


def fold_model(
    model: PreTrainedModel,
    *,
    check: bool = True,
    tied_head: TiedHead = "untie",
    probe: Optional[torch.Tensor] = None,
    tolerance: Optional[float] = None,
) -> PreTrainedModel:
    """Fold every tapered norm of a patched model at g = 0 into the modules that read it.

    Returns a new model of the registered folded class (``tapernorm_<model_type>``) on the same
    device and in the same dtype; ``model`` is not modified. Kept norms (``tapered=False``) stay
    real norms; a kept pre-norm of the RMS families (the final norm too) loses its weight to the modules
    it feeds, as ``flashnorm_model`` does (exact; one operation fewer per norm and token), so an export
    never runs more operations than the FlashNorm fold of its original; the other kept norms keep their
    weights. The scale anchor is training-only state and is dropped. A tapered final norm folds into
    ``lm_head``; with tied embeddings ``tied_head="untie"`` (default) gives the head its own weights and
    saves ``tie_word_embeddings=False`` (a kept RMS final norm's weight unties it the same way), ``"scale"``
    keeps the tie and one explicit per-channel scale (``FoldedChannelScale``) in place of a tapered final
    norm, or a kept final norm with its weight.

    With ``check`` (default) the folded logits are compared to the unfolded model's on ``probe``
    (default: a fixed random batch of 2 x 32 tokens); the result is ``folded.fold_report`` and a
    relative difference above ``tolerance`` (default by dtype: 1e-4 fp32, 5e-2 bf16) raises
    ``FoldCheckError``.
    """
    if tied_head not in TIED_HEAD_CHOICES:
        raise ConfigurationError(f"tied_head must be 'untie' or 'scale', got {tied_head!r}")
    _check_tolerance("fold_model", tolerance)
    model_type = model_type_of(model)
    _check_foldable(model, model_type)
    check_probe(model, probe)
    arch = architecture_of(model)  # the table entry, else automatic discovery (logged)
    register_folded_classes([model_type])
    sites = norm_sites(model, arch)
    fold = _fold_sites(model, sites, _is_tied(model, arch), tied_head)
    folded = _folded_model(model, model_type, arch, sites, fold, config_of(model).to_dict())
    refold = lambda unfolded: fold_model(unfolded, check=False, tied_head=tied_head)  # noqa: E731
    folded.fold_report = _fold_report(model, folded, check, probe, tolerance, refold)
    folded.model_card = render_model_card(folded)
    return folded


def flashnorm_model(
    model: PreTrainedModel,
    *,
    check: bool = True,
    probe: Optional[torch.Tensor] = None,
    tolerance: Optional[float] = None,
) -> PreTrainedModel:
    """FlashNorm (arXiv 2407.09577) of an unpatched model: exact, without training.

    Every pre-norm with parameters (the final norm too) gives its gain (``1 + w`` for Gemma) to the modules
    it feeds, W' = W diag(gain), and a LayerNorm its bias too, b' = b + W beta; the norm stays, weightless
    (``WeightlessRMSNorm``, or a LayerNorm without affine). A tied head is untied (its copy absorbs the final
    norm's weight). q/k norms and post-norms keep their weights: RoPE or the residual sum sits between them
    and any linear module. This is what a user who wants speed without training picks, so the benchmark
    measures every export against it.

    Returns a model of the registered folded class with no folded norm, every norm in ``kept_norms`` and the
    weightless ones in ``weightless_norms``; it saves and loads like an export (no model card). ``check``,
    ``probe`` and ``tolerance`` are those of ``fold_model``, against ``model``'s logits.
    """
    _check_tolerance("flashnorm_model", tolerance)
    model_type = model_type_of(model)
    _check_model(model, model_type, "flashnorm_model")
    if any(tapered_norms(model, include_kept=True)):
        raise TaperStateError(
            f"{type(model).__name__} is patched: flashnorm_model reads an unpatched model; fold_model folds a "
            "patched one at g = 0, its kept pre-norms made weightless the same way"
        )
    check_probe(model, probe)
    arch = architecture_of(model)
    register_folded_classes([model_type])
    sites = norm_sites(model, arch)
    tied = _is_tied(model, arch)
    fold = FoldState(state=dict(model.state_dict()))
    working: dict[str, WorkingProjection] = {}
    for site in sites:
        fold.kept_norms.append(site.path)
        norm = model.get_submodule(site.path)
        if site.kind != "input" or not any(isinstance(p, nn.Parameter) for p in norm.parameters(recurse=False)):
            continue
        if site.is_final and tied:
            fold.head_choice = "untie"
            _untie_warning(site.path, "FlashNorm: the", "its weight has nowhere else to go")
        make_weightless(model, fold, working, site, norm, arch.style)
    store_projections(fold, working)
    folded = _folded_model(model, model_type, arch, sites, fold, {})
    refold = lambda unfolded: flashnorm_model(unfolded, check=False)  # noqa: E731
    folded.fold_report = _fold_report(model, folded, check, probe, tolerance, refold)
    return folded


__all__ = [
    "FoldReport",
    "TIED_HEAD_CHOICES",
    "check_fold",
    "flashnorm_model",
    "fold_model",
    "tied_head_unused",
    "unties_head",
]
