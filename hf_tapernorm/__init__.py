"""Remove normalization from pretrained Hugging Face language models (TaperNorm, arXiv 2602.10408)."""

from .architectures import ARCHITECTURES, Architecture, NormSite, supported_model_types
from .calibration import calibrate, update_statistics
from .patching import gate_of, is_patched, patch_model, set_gate, taper_norms, tapered_norms
from .taper_norm import NormStyle, TaperNorm

__version__ = "0.1.0"

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "NormSite",
    "NormStyle",
    "TaperNorm",
    "calibrate",
    "gate_of",
    "is_patched",
    "patch_model",
    "set_gate",
    "supported_model_types",
    "taper_norms",
    "tapered_norms",
    "update_statistics",
]
