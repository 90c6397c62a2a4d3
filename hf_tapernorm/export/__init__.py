"""Export: fold a tapered model into a norm-free one, check it, register its classes, write and push it.
``modeling_folded.py`` is copied next to every export and imports nothing from hf_tapernorm.

The public names beyond ``fold_model``/``export_folded`` (which the top level exports too):

- :func:`flashnorm_model` (folding.py): FlashNorm of an unpatched model (its norm weights folded, exact),
  the peer ``hf-tapernorm bench`` measures exports against;
- :class:`FoldReport` (fold_check.py): what the fold check measured (``model.fold_report``);
- :func:`push_export` (hub.py): upload an export and its model card to the Hub;
- :func:`render_model_card`, :func:`attach_model_card` (model_card.py): the model card of an export;
- :func:`readout_summary`, :func:`readout_additivity_error` (readout.py): whether a model's logits are an affine
  readout of its residual stream (the final norm folded), from an export's config and measured;
  :func:`final_norm_path` the module an analysis reads the readout through (folded, kept or original);
- :func:`register_folded_classes` (registration.py): register the folded classes with the Auto classes
  by hand (``import hf_tapernorm`` already does it lazily).

Names resolve on first use: registration.py is imported while transformers sets up its Auto classes,
when its siblings could not be imported yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "fold_model": "folding",
    "flashnorm_model": "folding",
    "FoldReport": "fold_check",
    "export_folded": "writing",
    "push_export": "hub",
    "render_model_card": "model_card",
    "attach_model_card": "model_card",
    "register_folded_classes": "registration",
    "final_norm_path": "readout",
    "readout_additivity_error": "readout",
    "readout_summary": "readout",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .fold_check import FoldReport
    from .folding import flashnorm_model, fold_model
    from .hub import push_export
    from .model_card import attach_model_card, render_model_card
    from .readout import final_norm_path, readout_additivity_error, readout_summary
    from .registration import register_folded_classes
    from .writing import export_folded
