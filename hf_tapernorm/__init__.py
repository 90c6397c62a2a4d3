"""Remove normalization from pretrained Hugging Face language models (TaperNorm, arXiv 2602.10408).

The public API is imported on first use (PEP 562), so ``import hf_tapernorm`` costs almost nothing
over ``import torch, transformers``. Importing the package also makes folded exports loadable through
``AutoModelForCausalLM``: the folded model types are registered with transformers' Auto classes as
soon as those are imported (export/registration.py).

Layers, each importing only those above it in this list (tests/test_layering.py keeps it so):
``errors``/``utils`` -> ``architectures`` -> ``config`` -> ``layers`` (TaperNorm, patching) ->
``training`` -> ``export`` -> ``pipeline`` -> ``cli``/``bench``. Research helpers live outside the package
(conversion_scripts/experiments/research).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from ._import_hooks import run_after_import
from ._version import __version__
from .errors import (
    CalibrationError,
    ConfigurationError,
    FoldCheckError,
    TaperDivergenceError,
    TaperNormError,
    TaperStateError,
    UnsupportedModelError,
)

# public name -> module that defines it
_EXPORTS = {
    "TaperNormConfig": "config",
    "ARCHITECTURES": "architectures.table",
    "Architecture": "architectures.table",
    "NormSite": "architectures.table",
    "register_architecture": "architectures.table",
    "supported_model_types": "architectures.table",
    "NormStyle": "architectures.styles",
    "DiscoveryError": "architectures.discovery",
    "discover_architecture": "architectures.discovery",
    "architecture_of": "architectures.sites",
    "norms_feeding_gated_mlps": "architectures.recipe_rules",
    "norms_to_keep": "architectures.recipe_rules",
    "TaperNorm": "layers.taper_norm",
    "taper_norms": "layers.taper_norm",
    "tapered_norms": "layers.taper_norm",
    "is_patched": "layers.taper_norm",
    "ScaleAnchor": "layers.scale_anchor",
    "patch_model": "layers.patching",
    "set_gate": "layers.patching",
    "gate_of": "layers.patching",
    "set_sink_tokens": "layers.sink",
    "sink_prefix": "layers.sink",
    "sink_token_ids_of": "layers.sink",
    "TaperSchedule": "training.schedule",
    "calibrate": "training.calibration",
    "update_statistics": "training.calibration",
    "Distillation": "training.distillation",
    "DivergenceThresholds": "training.divergence",
    "TaperController": "training.controller",
    "TaperCallback": "training.callback",
    "fold_model": "export.folding",
    "FoldReport": "export.fold_check",
    "export_folded": "export.hub",
    "push_export": "export.hub",
    "render_model_card": "export.model_card",
    "attach_model_card": "export.model_card",
    "register_folded_classes": "export.registration",
    "load_tapered": "training.checkpoints",
    "save_sharded_checkpoint": "training.sharded",
    "load_sharded_checkpoint": "training.sharded",
    "save_tapered": "training.checkpoints",
}

__all__ = sorted([*_EXPORTS, *errors.__all__, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_tapernorm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def _register_folded_types() -> None:
    from .export.registration import register_lazily

    register_lazily()


run_after_import("transformers.models.auto.configuration_auto", _register_folded_types)

if TYPE_CHECKING:  # static type checkers and IDEs see the eager imports
    from .architectures.discovery import DiscoveryError, discover_architecture
    from .architectures.recipe_rules import norms_feeding_gated_mlps, norms_to_keep
    from .architectures.sites import architecture_of
    from .architectures.styles import NormStyle
    from .architectures.table import (
        ARCHITECTURES,
        Architecture,
        NormSite,
        register_architecture,
        supported_model_types,
    )
    from .config import TaperNormConfig
    from .export.fold_check import FoldReport
    from .export.folding import fold_model
    from .export.hub import export_folded, push_export
    from .export.model_card import attach_model_card, render_model_card
    from .export.registration import register_folded_classes
    from .layers.patching import gate_of, patch_model, set_gate
    from .layers.scale_anchor import ScaleAnchor
    from .layers.sink import set_sink_tokens, sink_prefix, sink_token_ids_of
    from .layers.taper_norm import TaperNorm, is_patched, taper_norms, tapered_norms
    from .training.calibration import calibrate, update_statistics
    from .training.callback import TaperCallback
    from .training.checkpoints import load_tapered, save_tapered
    from .training.controller import TaperController
    from .training.distillation import Distillation
    from .training.divergence import DivergenceThresholds
    from .training.schedule import TaperSchedule
    from .training.sharded import load_sharded_checkpoint, save_sharded_checkpoint
