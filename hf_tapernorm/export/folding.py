"""fold_model: turn a patched model at gate 0 into a norm-free model of a registered folded class.

At g = 0 every tapered norm is the fixed map h -> h A + beta with A = c D_gammat (RMS) or
A = c (I - 11^T/d) D_gammat (LayerNorm), and folds into the modules the architecture table says
read it (docs/method.md, section 5). The algebra is one routine per site kind, driven by the table:

- ``"input"`` (a pre-norm): the consumers' input columns, W' = W A, bias' = bias + W beta;
- ``"per_head"`` / ``"output"`` (a q/k norm or a post-norm on a branch output): the producers'
  output rows, repeated per group of ``d`` rows, W' = A^T W, bias' = A^T bias + beta.

Everything is computed in float64 on working copies (so a projection that absorbs two norms is
folded exactly) and cast once to each weight's own dtype. Conv1D ([in, out]) weights are handled
by transposing into nn.Linear layout and back.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from .._version import __version__
from ..architectures.sites import architecture_of, model_type_of, norm_sites
from ..architectures.styles import NormStyle
from ..config import config_of
from ..errors import CalibrationError, ConfigurationError, TaperStateError, UnsupportedModelError
from ..layers.sink import sink_outputs, sink_token_ids_of
from ..layers.taper_norm import TaperNorm, tapered_norms
from ..training.distributed import sharding_engine
from .fold_check import FoldReport, check_fold, check_probe
from .model_card import render_model_card
from .modeling_folded import PREFIX, folded_classes
from .registration import register_folded_classes

logger = logging.getLogger(__name__)

TiedHead = Literal["untie", "scale"]
TIED_HEAD_CHOICES = ("untie", "scale")


def _check_foldable(model: nn.Module, model_type: str) -> None:
    if sharding_engine(model) is not None:
        raise TaperStateError(
            f"{type(model).__name__} is sharded ({sharding_engine(model)}): fold the gathered model, e.g. "
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) loaded into an unsharded "
            "copy, or `hf-tapernorm fold --checkpoint` on a sharded checkpoint (docs/distributed.md)"
        )
    if model_type.startswith(PREFIX):  # a loaded export (remote code too): its norms are gone already
        raise TaperStateError(
            f"{type(model).__name__} is already folded (a norm-free export): use it as it is; fold_model reads a "
            "patched model tapered to gate 0 (load_tapered(folder) for a tapered checkpoint)"
        )
    if not any(tapered_norms(model, include_kept=True)):
        raise TaperStateError(
            f"{type(model).__name__} is not patched: fold_model needs a model patched with patch_model, "
            "calibrated and tapered to gate 0"
        )
    base_class = folded_classes(model_type)[1].__bases__[-1]
    if hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule around the model
        raise UnsupportedModelError(
            f"fold_model expects a {base_class.__name__}, got torch.compile's {type(model).__name__}: fold the "
            "module it wraps, fold_model(model._orig_mod)"
        )
    if not isinstance(model, base_class):
        peft = hasattr(model, "merge_and_unload")
        unmerged = "; merge its PEFT adapters first: fold_model(model.merge_and_unload())" if peft else ""
        raise UnsupportedModelError(f"fold_model expects a {base_class.__name__}, got {type(model).__name__}{unmerged}")
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


class _Working:
    """A float64 working copy of one projection in nn.Linear layout ([out, in])."""

    def __init__(self, module: nn.Module, path: str) -> None:
        if isinstance(module, nn.Linear):
            self.transposed = False
        elif isinstance(module, Conv1D):
            self.transposed = True
        else:
            raise UnsupportedModelError(
                f"cannot fold into {path}: {type(module).__name__} is neither nn.Linear nor Conv1D"
            )
        weight = module.weight.detach()
        if not weight.is_floating_point():
            raise UnsupportedModelError(
                f"cannot fold into {path}: its weight is {weight.dtype} (a quantized model?); load the model in a "
                "floating dtype, fold, then quantize the folded model"
            )
        self.weight = (weight.t() if self.transposed else weight).to(torch.float64).clone()
        self.bias = module.bias.detach().to(torch.float64).clone() if module.bias is not None else None
        self.had_bias = module.bias is not None
        self.weight_dtype = module.weight.dtype
        self.bias_dtype = module.bias.dtype if module.bias is not None else module.weight.dtype

    def fold_input(self, scale: torch.Tensor, beta: Optional[torch.Tensor], centred: bool) -> None:
        """The projection reads ``(h - mu) * scale + beta`` (or ``h * scale``): W' = W A, b' = b + W beta."""
        if beta is not None:
            shift = self.weight @ beta
            self.bias = shift if self.bias is None else self.bias + shift
        self.weight = self.weight * scale[None, :]
        if centred:
            self.weight = self.weight - self.weight.mean(dim=1, keepdim=True)

    def fold_output(self, scale: torch.Tensor, beta: Optional[torch.Tensor], centred: bool) -> None:
        """The projection's output, in groups of ``len(scale)`` rows, is normalized at g = 0 then scaled."""
        group = scale.numel()
        out_features = self.weight.shape[0]
        if out_features % group:
            raise UnsupportedModelError(f"cannot fold a norm of size {group} into {out_features} output rows")
        rows = self.weight.view(out_features // group, group, -1)
        bias = self.bias.view(-1, group) if self.bias is not None else None
        if centred:
            rows = rows - rows.mean(dim=1, keepdim=True)
            bias = bias - bias.mean(dim=1, keepdim=True) if bias is not None else None
        self.weight = (rows * scale[None, :, None]).reshape(out_features, -1)
        if bias is not None:
            bias = bias * scale[None, :]
        if beta is not None:
            bias = beta[None, :].expand(out_features // group, group) + (bias if bias is not None else 0.0)
        self.bias = bias.reshape(-1) if bias is not None else None

    def tensors(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        weight = self.weight.t() if self.transposed else self.weight
        bias = self.bias.to(self.bias_dtype) if self.bias is not None else None
        return weight.to(self.weight_dtype).contiguous(), bias


def _linear_map(layer: TaperNorm) -> tuple[torch.Tensor, Optional[torch.Tensor], bool]:
    """(scale = c * gammat, beta or None when absent/zero, centred) of a TaperNorm at g = 0, in float64."""
    scale = layer.c.detach().to(torch.float64) * layer.taper_weight.detach().to(torch.float64)
    centred = layer.style is NormStyle.LAYER
    beta = None
    if centred and layer.bias is not None and bool(layer.bias.detach().ne(0).any()):
        beta = layer.bias.detach().to(torch.float64)
    return scale, beta, centred


def _learned_positions(model: PreTrainedModel) -> int:
    """The size of the model's learned position table (GPT-2's ``wpe``, OPT's ``embed_positions``), else 0.

    A sink export stores its sink at the first positions: with a table, sink and text share its rows.
    """
    limit = getattr(model.config, "max_position_embeddings", None)
    embeddings = model.get_input_embeddings()
    if not isinstance(limit, int):
        return 0
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module is not embeddings and module.num_embeddings >= limit:
            return limit
    return 0


@dataclass
class _Fold:
    """What folding the norm sites produced: the folded model's state dict and the structure its config records."""

    state: dict[str, torch.Tensor]
    folded_norms: list[str] = field(default_factory=list)
    kept_norms: list[str] = field(default_factory=list)
    scaled_norms: list[str] = field(default_factory=list)
    added_biases: list[str] = field(default_factory=list)
    head_choice: Optional[str] = None  # the tied-head policy applied, when a tapered final norm met tied embeddings
    projections: int = 0


def _is_tied(model: PreTrainedModel, arch) -> bool:
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embeddings is not None and head.weight is embeddings.weight
    return tied and model.get_submodule(arch.lm_head) is head  # OPT's project_out reads the final norm, not the head


def _keep_final_scale(fold: _Fold, path: str, layer: TaperNorm, scale, beta, centred: bool) -> None:
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


def _fold_sites(model: PreTrainedModel, sites, tied: bool, tied_head: TiedHead) -> _Fold:
    """Fold every tapered site into the projections that read it; keep the kept norms; apply the tied-head policy."""
    fold = _Fold(state=dict(model.state_dict()))
    working: dict[str, _Working] = {}
    for site in sites:
        layer = model.get_submodule(site.path)
        if not isinstance(layer, TaperNorm):
            raise TaperStateError(f"{site.path} is a {type(layer).__name__}, not a TaperNorm: patch the whole model")
        for key in [k for k in fold.state if k.startswith(site.path + ".")]:
            del fold.state[key]
        if not layer.tapered:
            fold.kept_norms.append(site.path)
            for name in ("weight", "bias"):
                if getattr(layer, name) is not None:
                    fold.state[f"{site.path}.{name}"] = getattr(layer, name).detach()
            continue
        scale, beta, centred = _linear_map(layer)
        if site.is_final and tied:
            fold.head_choice = tied_head
            if tied_head == "scale":
                _keep_final_scale(fold, site.path, layer, scale, beta, centred)
                continue
            logger.warning(
                "tapered final norm %s folds into a tied lm_head: the head is untied and saved with "
                "tie_word_embeddings=False (pass tied_head='scale' to keep the tie)",
                site.path,
            )
        fold.folded_norms.append(site.path)
        for path in site.modules:
            if path not in working:
                working[path] = _Working(model.get_submodule(path), path)
            if site.kind == "input":
                working[path].fold_input(scale, beta, centred)
            else:
                working[path].fold_output(scale, beta, centred)
    for path, work in working.items():
        weight, bias = work.tensors()
        fold.state[f"{path}.weight"] = weight
        if bias is not None:
            fold.state[f"{path}.bias"] = bias
            if not work.had_bias:
                fold.added_biases.append(path)
    fold.projections = len(working)
    return fold


def _store_sink(model: PreTrainedModel, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Put the sink's keys/values and logits in ``state``; returns the config fields that describe them."""
    sink_ids = sink_token_ids_of(model)
    if not sink_ids:
        return {"sink_token_ids": [], "sink_cache_shape": [], "sink_logits_shape": [], "sink_max_positions": 0}
    state["sink_keys"], state["sink_values"], state["sink_logits"] = sink_outputs(model, sink_ids)
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
        "sink_logits_shape": list(state["sink_logits"].shape),
        "sink_max_positions": _learned_positions(model),
    }


def _folded_config(model: PreTrainedModel, config_class: type, model_type: str, arch, sites, fold: _Fold, sink: dict):
    """The folded config: the base config (less what does not carry over) plus what folding did."""
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
        scaled_norms=fold.scaled_norms,
        added_biases=fold.added_biases,
        centred_norms=arch.style is NormStyle.LAYER,
        tied_head=fold.head_choice,
        **sink,
        hf_tapernorm_version=__version__,
        tapernorm_config=config_of(model).to_dict(),
    )


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
    real norms of the base class; the scale anchor is training-only state and is dropped. A tapered
    final norm folds into ``lm_head``; with tied embeddings ``tied_head="untie"`` (default) gives the
    head its own weights and saves ``tie_word_embeddings=False``, ``"scale"`` keeps the tie and one
    explicit per-channel scale (``FoldedChannelScale``) in place of the final norm.

    With ``check`` (default) the folded logits are compared to the unfolded model's on ``probe``
    (default: a fixed random batch of 2 x 32 tokens); the result is ``folded.fold_report`` and a
    relative difference above ``tolerance`` (default by dtype: 1e-4 fp32, 5e-2 bf16) raises
    ``FoldCheckError``.
    """
    if tied_head not in TIED_HEAD_CHOICES:
        raise ConfigurationError(f"tied_head must be 'untie' or 'scale', got {tied_head!r}")
    number = isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool)  # True would be 1.0: no check
    if tolerance is not None and not (number and 0 < tolerance < math.inf):
        raise ConfigurationError(f"fold_model: tolerance must be a positive finite number, got {tolerance!r}")
    model_type = model_type_of(model)
    _check_foldable(model, model_type)
    check_probe(model, probe)
    arch = architecture_of(model)  # the table entry, else automatic discovery (logged)
    config_class, model_class = folded_classes(model_type)
    register_folded_classes([model_type])
    sites = norm_sites(model, arch)
    fold = _fold_sites(model, sites, _is_tied(model, arch), tied_head)
    sink = _store_sink(model, fold.state)
    config = _folded_config(model, config_class, model_type, arch, sites, fold, sink)
    folded = model_class.from_pretrained(
        None,
        config=config,
        state_dict=fold.state,
        dtype=model.dtype,
        attn_implementation=model.config._attn_implementation,
    ).to(next(model.parameters()).device)
    folded.generation_config = copy.deepcopy(model.generation_config)
    folded.config.name_or_path = model.config.name_or_path
    logger.info(
        "folded %d norm(s) of %s into %d projection(s); kept %d norm(s)%s",
        len(fold.folded_norms),
        model_type,
        fold.projections,
        len(fold.kept_norms),
        f"; added a bias to {', '.join(fold.added_biases)}" if fold.added_biases else "",
    )
    refold = lambda unfolded: fold_model(unfolded, check=False, tied_head=tied_head)  # noqa: E731
    folded.fold_report = check_fold(model, folded, probe=probe, tolerance=tolerance, refold=refold) if check else None
    if folded.fold_report is not None:
        logger.info(
            "fold check: max abs logit diff %.3g, max relative %.3g",
            folded.fold_report.max_abs_diff,
            folded.fold_report.max_rel_diff,
        )
    folded.model_card = render_model_card(folded)
    return folded


__all__ = ["FoldReport", "TIED_HEAD_CHOICES", "check_fold", "fold_model"]
