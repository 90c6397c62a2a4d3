"""Where norm-free models are used: interpretability tools and a CPU runtime, each an optional extra.

- tl_bridge.py: a folded export in TransformerLens (``TransformerBridge``), its sink in place
  (extra ``interpretability``);
- nnsight_model.py: a folded export wrapped by nnsight for tracing and interventions (extra ``interpretability``);
- onnx_runtime.py: the export (or any causal LM) as an ONNX graph with its KV cache and stored sink, run in
  ONNX Runtime (extra ``onnx``).

None of these packages is a dependency of hf_tapernorm: each module imports its tool when a function is
called, and a missing one raises ``MissingExtraError`` naming the extra to install (extras.py).
"""
