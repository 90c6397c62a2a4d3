"""Remove normalization from pretrained Hugging Face language models (TaperNorm, arXiv 2602.10408)."""

from .architectures import ARCHITECTURES, Architecture, NormSite, supported_model_types
from .calibration import calibrate, update_statistics
from .discovery import DiscoveryError, architecture_of, discover_architecture
from .patching import gate_of, is_patched, norms_feeding_gated_mlps, patch_model, set_gate, taper_norms, tapered_norms
from .taper_norm import NormStyle, TaperNorm
from .schedule import TaperSchedule
from .scale_loss import ScaleAnchor
from .controller import TaperController, TaperDivergenceError
from .callback import TaperCallback
from .folding import FoldCheckError, FoldReport, fold_model, register_folded_classes
from .model_card import attach_model_card, render_model_card
from .export import export_folded
from .calibration import fit_linear_branch
from .regularizers import TokenScalePenalty, distillation_loss
from .recipes import TaperRecipe, apply_recipe, recipe_for
from .sink import set_sink_tokens, sink_prefix, sink_token_ids_of

__version__ = "0.1.0"

register_folded_classes()  # AutoConfig / AutoModelForCausalLM know the tapernorm_* model types

__all__ = [
    "ARCHITECTURES",
    "FoldCheckError",
    "FoldReport",
    "Architecture",
    "DiscoveryError",
    "NormSite",
    "NormStyle",
    "ScaleAnchor",
    "TaperCallback",
    "TaperController",
    "TaperDivergenceError",
    "TaperSchedule",
    "TaperNorm",
    "architecture_of",
    "attach_model_card",
    "calibrate",
    "discover_architecture",
    "export_folded",
    "fold_model",
    "gate_of",
    "is_patched",
    "norms_feeding_gated_mlps",
    "patch_model",
    "register_folded_classes",
    "render_model_card",
    "set_gate",
    "supported_model_types",
    "taper_norms",
    "tapered_norms",
    "update_statistics",
    "fit_linear_branch",
    "TokenScalePenalty",
    "distillation_loss",
    "TaperRecipe",
    "apply_recipe",
    "recipe_for",
    "set_sink_tokens",
    "sink_prefix",
    "sink_token_ids_of",
]
