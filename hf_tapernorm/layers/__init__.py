"""The modules patched into a model (TaperNorm, the scale anchor, the sink prefix, the loss-term hooks) and
``patch_model``, which puts them there. Depends on architectures/ and config only."""
