"""A folded export wrapped by nnsight (``NNsight``): trace, save and edit any module's output.

nnsight runs the wrapped module itself, so the export's own forward hooks (the stored sink put in front of
the text) run inside every trace, and the traced logits are the export's. Module paths are the base
family's (``model.layers.{i}.mlp`` for Llama, ``transformer.h.{i}.mlp`` for GPT-2); a folded norm is an
``nn.Identity`` there, its output its input.
"""

from __future__ import annotations

from typing import Union

import torch

from .exports import ExportSource, load_export
from .extras import require

FEATURE = "hf_tapernorm.integrations.nnsight_tracing"


def nnsight_model(source: ExportSource, *, dtype: Union[torch.dtype, str, None] = None):
    """``nnsight.NNsight`` over the folded export ``source`` (a folder or a folded model), in eval mode; ``dtype`` as
    for ``load_export`` (a folder's, float32 by default; a model keeps its own)."""
    nnsight = require("nnsight", FEATURE)
    return nnsight.NNsight(load_export(source, dtype=dtype))


__all__ = ["nnsight_model"]
