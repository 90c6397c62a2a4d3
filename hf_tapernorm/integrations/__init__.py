"""Where norm-free models are used: interpretability tools and a CPU runtime, each an optional extra.

- :func:`transformer_bridge` (tl_bridge.py): a folded export in TransformerLens (``TransformerBridge``), its sink
  in place (extra ``interpretability``);
- :func:`nnsight_model` (nnsight_tracing.py): a folded export wrapped by nnsight for tracing and interventions
  (extra ``interpretability``);
- :func:`export_onnx`, :class:`OnnxCausalLM` (onnx_runtime.py): the export (or any causal LM) as an ONNX graph
  with its KV cache and stored sink, run in ONNX Runtime (extra ``onnx``);
- :func:`load_export` (exports.py): an export folder (or, with ``folded_only=False``, any causal LM folder)
  loaded for these tools;
- :func:`require`, :class:`MissingExtraError` (extras.py): import an extra's package, or one line naming the extra.

None of these packages is a dependency of hf_tapernorm: each module imports its tool when a function is
called, and a missing one raises ``MissingExtraError`` naming the extra to install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "transformer_bridge": "tl_bridge",
    "nnsight_model": "nnsight_tracing",
    "OnnxCausalLM": "onnx_runtime",
    "export_onnx": "onnx_runtime",
    "load_export": "exports",
    "MissingExtraError": "extras",
    "require": "extras",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .exports import load_export
    from .extras import MissingExtraError, require
    from .nnsight_tracing import nnsight_model
    from .onnx_runtime import OnnxCausalLM, export_onnx
    from .tl_bridge import transformer_bridge
