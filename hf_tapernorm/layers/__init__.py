"""The modules patched into a model (TaperNorm, the scale anchor, the sink prefix, the loss-term hooks) and
``patch_model``, which puts them there. Depends on architectures/ and config only.

The public names, for looking inside a patched model or driving the gate by hand:

- :class:`TaperNorm` (taper_norm.py): the layer, ``g * norm(h) + (1 - g) * c * gain * h``;
- :func:`tapered_norms` (taper_norm.py): the TaperNorms of a model (``include_kept=True``: the kept ones too);
- :func:`train_tapernorm_parameters` (taper_norm.py): make their parameters trainable under PEFT/LoRA;
- :func:`patch_model`, :func:`set_gate`, :func:`gate_of` (patching.py): patch a model, set or read its gate;
- :class:`ScaleAnchor` (scale_anchor.py): the fixed-target scale loss on the final norm's input;
- :func:`set_sink_tokens`, :func:`sink_token_ids_of`, :func:`sink_prefix` (sink.py): the attention-sink
  tokens kept normalized, and the constant key/value prefix they fold into;
- :func:`add_training_loss_term`, :func:`remove_training_loss_term`, :class:`ForwardInputs` (loss_terms.py):
  extra terms added to ``outputs.loss`` in training mode (the scale loss and distillation are two; research
  penalties add their own), and :func:`in_backward_recompute` (utils.py), true while gradient checkpointing
  re-runs a forward, when a term must not count again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "TaperNorm": "taper_norm",
    "tapered_norms": "taper_norm",
    "train_tapernorm_parameters": "taper_norm",
    "patch_model": "patching",
    "set_gate": "patching",
    "gate_of": "patching",
    "ScaleAnchor": "scale_anchor",
    "set_sink_tokens": "sink",
    "sink_prefix": "sink",
    "sink_token_ids_of": "sink",
    "ForwardInputs": "loss_terms",
    "add_training_loss_term": "loss_terms",
    "remove_training_loss_term": "loss_terms",
    "in_backward_recompute": ".utils",  # hf_tapernorm.utils (the bottom layer), part of the loss-term API
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from ..utils import in_backward_recompute
    from .loss_terms import ForwardInputs, add_training_loss_term, remove_training_loss_term
    from .patching import gate_of, patch_model, set_gate
    from .scale_anchor import ScaleAnchor
    from .sink import set_sink_tokens, sink_prefix, sink_token_ids_of
    from .taper_norm import TaperNorm, tapered_norms, train_tapernorm_parameters
