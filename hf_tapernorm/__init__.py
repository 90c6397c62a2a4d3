"""Remove normalization from pretrained Hugging Face language models (TaperNorm, arXiv 2602.10408).

The top level is the stable API: the recipe (:class:`TaperNormConfig`), :func:`patch_model`, the two
training drivers (:class:`TaperCallback` for the Trainer, :class:`TaperController` for any loop),
:func:`fold_model` and :func:`export_folded`, the tapered and sharded checkpoint save/load pairs, and the
errors. Everything else is imported from its subpackage, where it is documented (docs/usage.md, "API"):

- ``hf_tapernorm.architectures``: the architecture table and automatic discovery (adding a family);
- ``hf_tapernorm.layers``: the TaperNorm module, the gate, the sink tokens;
- ``hf_tapernorm.training``: the schedule, calibration, distillation, the divergence watch;
- ``hf_tapernorm.export``: the fold check, the model card, the Hub upload.

Names resolve on first use (PEP 562), so ``import hf_tapernorm`` costs almost nothing over
``import torch, transformers``. Importing the package also makes folded exports loadable through
``AutoModelForCausalLM``: the folded model types are registered with transformers' Auto classes as soon
as those are imported (export/registration.py).

Layers, each importing only those above it in this list (tests/test_layering.py keeps it so):
``errors``/``utils`` -> ``architectures`` -> ``data`` -> ``config`` -> ``layers`` (TaperNorm, patching) ->
``training`` -> ``export`` -> ``evaluation`` -> ``app`` -> ``integrations`` -> ``bench`` -> ``cli``. Research code lives
outside the package (conversion_scripts/experiments) and uses only these documented names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import errors
from ._import_hooks import run_after_import
from ._lazy import lazy_exports
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
    "patch_model": "layers.patching",
    "TaperCallback": "training.callback",
    "TaperController": "training.controller",
    "save_tapered": "training.checkpoints",
    "load_tapered": "training.checkpoints",
    "save_sharded_checkpoint": "training.sharded",
    "load_sharded_checkpoint": "training.sharded",
    "fold_model": "export.folding",
    "export_folded": "export.writing",
}

__all__ = sorted([*_EXPORTS, *errors.__all__, "__version__"])

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


def _register_folded_types() -> None:
    from .export.registration import register_lazily

    register_lazily()


run_after_import("transformers.models.auto.configuration_auto", _register_folded_types)

if TYPE_CHECKING:  # static type checkers and IDEs see the eager imports
    from .config import TaperNormConfig
    from .export.folding import fold_model
    from .export.writing import export_folded
    from .layers.patching import patch_model
    from .training.callback import TaperCallback
    from .training.checkpoints import load_tapered, save_tapered
    from .training.controller import TaperController
    from .training.sharded import load_sharded_checkpoint, save_sharded_checkpoint
