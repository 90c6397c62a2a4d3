"""One declarative table: which modules of each architecture are norms, and who reads them.

Patching uses it to find the norms; folding uses the same entries to know which projections absorb
each tapered norm. Paths are relative to one decoder layer (``sites``) or to the base model
(``final_norm``); ``lm_head`` is relative to the ``*ForCausalLM`` wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .taper_norm import NormStyle


@dataclass(frozen=True)
class NormSite:
    """One norm inside a decoder layer and the linear modules that read its output.

    ``kind``: ``"input"`` (a pre-norm whose output feeds the consumers' inputs), ``"per_head"`` (a
    q/k norm acting on each head before RoPE: it folds into the consumers' output rows, repeated per
    head), ``"output"`` (a post-norm on a branch output: it folds into the producers' output rows).
    """

    path: str
    consumers: tuple[str, ...]
    kind: str = "input"


@dataclass(frozen=True)
class Architecture:
    model_type: str
    style: NormStyle
    layers: str  # path of the decoder-layer ModuleList inside the base model
    sites: tuple[NormSite, ...]
    final_norm: str  # path inside the base model
    lm_head: str = "lm_head"
    conv1d: bool = False  # consumers are GPT-2 Conv1D ([in, out] weights) rather than nn.Linear
    notes: tuple[str, ...] = field(default_factory=tuple)


_LLAMA_SITES = (
    NormSite("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    NormSite("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
)

ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", NormStyle.RMS, "layers", _LLAMA_SITES, "norm"),
    "gpt2": Architecture(
        "gpt2",
        NormStyle.LAYER,
        "h",
        (NormSite("ln_1", ("attn.c_attn",)), NormSite("ln_2", ("mlp.c_fc",))),
        "ln_f",
        conv1d=True,
    ),
}


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def architecture_for(model_type: str) -> Architecture:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise ValueError(
            f"model_type '{model_type}' is not supported by hf_tapernorm; supported model types: "
            f"{', '.join(supported_model_types())}"
        ) from None
