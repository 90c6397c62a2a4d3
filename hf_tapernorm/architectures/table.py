"""One declarative table: which modules of each architecture are norms, who reads them, and what they feed.

Patching uses it to find the norms; folding uses the same entries to know which projections absorb
each tapered norm; the recipe rules (``recipe_rules.py``) read each site's ``role`` to decide which
norms a pretrained model can lose. Paths are relative to one decoder layer (``sites``) or to the base
model (``final_norm``); ``lm_head`` (the module that reads the final norm: the head, or OPT's
``project_out``) is relative to the ``*ForCausalLM`` wrapper. Architectures without an entry are
described by ``discovery.discover_architecture`` in the same terms, and users add their own with
:func:`register_architecture` (see docs/adding_an_architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Union

from ..errors import UnsupportedModelError
from .styles import NormStyle

#: How a norm folds: ``"input"`` (a pre-norm: into its consumers' input columns), ``"per_head"`` (a q/k
#: norm acting on each head before RoPE: into the producer's output rows, repeated per head),
#: ``"output"`` (a norm on a branch output: into the producer's output rows).
SiteKind = Literal["input", "per_head", "output"]
#: What the norm's output feeds, which decides how the consumer grows with a token's scale once the norm
#: is linear (recipe_rules.py): attention, the MLP, both (a parallel block's shared norm), the queries and
#: keys (q/k norms), or the residual stream after a branch (post-norms).
SiteRole = Literal["attention", "mlp", "attention_mlp", "qk", "attention_output", "mlp_output"]
SITE_ROLES = ("attention", "mlp", "attention_mlp", "qk", "attention_output", "mlp_output")


@dataclass(frozen=True)
class NormSite:
    """One norm inside a decoder layer and the linear modules that read (``input``) or produce its data."""

    path: str
    consumers: tuple[str, ...]
    kind: SiteKind = "input"
    role: SiteRole = "attention"
    #: The sequence axis of the norm's input, from the end: -2 for ``[batch, seq, hidden]`` and for q/k norms
    #: applied after the head transpose (``[batch, heads, seq, head_dim]``), -3 for q/k norms applied before it
    #: (``[batch, seq, heads, head_dim]``, Qwen 3). The sink positions are cut along it.
    sequence_dim: int = -2


@dataclass(frozen=True)
class Architecture:
    """Where the norms of one family are, and whether its MLP is gated (SwiGLU/GeGLU: degree 2)."""

    model_type: str
    style: NormStyle
    layers: str  # path of the decoder-layer ModuleList inside the base model
    sites: tuple[NormSite, ...]
    final_norm: str  # path inside the base model
    lm_head: str = "lm_head"
    gated_mlp: bool = False


_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_LLAMA_SITES = (
    NormSite("input_layernorm", _ATTN, role="attention"),
    NormSite("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), role="mlp"),
)
# q_norm/k_norm act on each head of the q/k projections before RoPE: they fold into those output rows.
_QK_NORM_SITES = (
    NormSite("self_attn.q_norm", ("self_attn.q_proj",), "per_head", "qk"),
    NormSite("self_attn.k_norm", ("self_attn.k_proj",), "per_head", "qk"),
)
# Qwen 3 normalizes each head before the transpose: its q/k norms see [batch, seq, heads, head_dim].
_QK_NORM_SITES_BEFORE_TRANSPOSE = tuple(
    NormSite(site.path, site.consumers, site.kind, site.role, sequence_dim=-3) for site in _QK_NORM_SITES
)
# Gemma 2/3: a pre-norm and a post-norm around each branch; the post-norms scale the branch outputs.
_GEMMA2_SITES = (
    NormSite("input_layernorm", _ATTN, role="attention"),
    NormSite("post_attention_layernorm", ("self_attn.o_proj",), "output", "attention_output"),
    NormSite("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), role="mlp"),
    NormSite("post_feedforward_layernorm", ("mlp.down_proj",), "output", "mlp_output"),
)


def _phi(config: Any) -> Architecture:
    # One shared pre-norm feeds attention AND the MLP (parallel block); optional per-head q/k LayerNorms.
    sites = (NormSite("input_layernorm", (*_ATTN, "mlp.fc1"), role="attention_mlp"),)
    if getattr(config, "qk_layernorm", False):
        sites += (
            NormSite("self_attn.q_layernorm", ("self_attn.q_proj",), "per_head", "qk"),
            NormSite("self_attn.k_layernorm", ("self_attn.k_proj",), "per_head", "qk"),
        )
    return Architecture("phi", NormStyle.LAYER, "layers", sites, "final_layernorm")


def _opt(config: Any) -> Architecture:
    if not config.do_layer_norm_before:
        raise UnsupportedModelError(
            "OPT with do_layer_norm_before=False (post-LN, e.g. facebook/opt-350m) is not supported: its norms "
            "sit on the residual stream after each block, where nothing linear can absorb them; TaperNorm "
            "folding covers pre-norm models only"
        )
    if config._remove_final_layer_norm:
        raise UnsupportedModelError(
            "OPT with _remove_final_layer_norm=True has no final norm; hf_tapernorm needs the final norm "
            "(it anchors the output scale)"
        )
    sites = (
        NormSite("self_attn_layer_norm", _ATTN, role="attention"),
        NormSite("final_layer_norm", ("fc1",), role="mlp"),
    )
    # With word_embed_proj_dim != hidden_size the final norm feeds project_out, not lm_head.
    head = "model.decoder.project_out" if config.word_embed_proj_dim != config.hidden_size else "lm_head"
    return Architecture("opt", NormStyle.LAYER, "decoder.layers", sites, "decoder.final_layer_norm", head)


def _falcon(config: Any) -> Architecture:
    # Three layouts, chosen exactly as FalconDecoderLayer.forward chooses them.
    qkv, fc = "self_attention.query_key_value", "mlp.dense_h_to_4h"
    num_ln = config.num_ln_in_parallel_attn
    if config.new_decoder_architecture and num_ln in (None, 2):
        sites = (NormSite("ln_attn", (qkv,), role="attention"), NormSite("ln_mlp", (fc,), role="mlp"))
    elif config.new_decoder_architecture or config.parallel_attn:
        sites = (NormSite("input_layernorm", (qkv, fc), role="attention_mlp"),)  # one shared norm
    else:
        sites = (
            NormSite("input_layernorm", (qkv,), role="attention"),
            NormSite("post_attention_layernorm", (fc,), role="mlp"),
        )
    return Architecture("falcon", NormStyle.LAYER, "h", sites, "ln_f")


def _llama_like(model_type: str, style: NormStyle = NormStyle.RMS, sites=_LLAMA_SITES) -> Architecture:
    return Architecture(model_type, style, "layers", sites, "norm", gated_mlp=True)


#: A value is either an Architecture or, where the layout depends on the config, a function of the config.
ArchitectureEntry = Union[Architecture, Callable[[Any], Architecture]]

ARCHITECTURES: dict[str, ArchitectureEntry] = {
    "llama": _llama_like("llama"),
    "mistral": _llama_like("mistral"),
    "qwen2": _llama_like("qwen2"),
    "qwen3": _llama_like("qwen3", sites=_QK_NORM_SITES_BEFORE_TRANSPOSE + _LLAMA_SITES),
    "gemma": _llama_like("gemma", NormStyle.RMS_OFFSET),
    "gemma2": _llama_like("gemma2", NormStyle.RMS_OFFSET, _GEMMA2_SITES),
    "gemma3_text": _llama_like("gemma3_text", NormStyle.RMS_OFFSET, _QK_NORM_SITES + _GEMMA2_SITES),
    "phi": _phi,
    "phi3": _llama_like(
        "phi3",
        sites=(
            NormSite("input_layernorm", ("self_attn.qkv_proj",), role="attention"),  # fused q/k/v
            NormSite("post_attention_layernorm", ("mlp.gate_up_proj",), role="mlp"),  # fused gate/up
        ),
    ),
    "gpt_neox": Architecture(
        "gpt_neox",
        NormStyle.LAYER,
        "layers",
        # Both norms read the layer input when use_parallel_residual=True; their consumers are the same either way.
        (
            NormSite("input_layernorm", ("attention.query_key_value",), role="attention"),
            NormSite("post_attention_layernorm", ("mlp.dense_h_to_4h",), role="mlp"),
        ),
        "final_layer_norm",
    ),
    "opt": _opt,
    "falcon": _falcon,
    "gpt2": Architecture(
        "gpt2",
        NormStyle.LAYER,
        "h",
        (NormSite("ln_1", ("attn.c_attn",), role="attention"), NormSite("ln_2", ("mlp.c_fc",), role="mlp")),
        "ln_f",
    ),
}


def register_architecture(model_type: str, entry: ArchitectureEntry, *, exist_ok: bool = False) -> None:
    """Declare the norm layout of ``model_type`` (an Architecture, or a function of the config returning one).

    The extension point for a family that discovery cannot describe or that deserves an explicit entry:
    after this call, patching, folding and the recipe rules treat it like a built-in family. The folded
    export's classes are built from transformers' own classes for ``model_type``. Refuses to replace an
    entry unless ``exist_ok``.
    """
    if model_type in ARCHITECTURES and not exist_ok:
        raise ValueError(
            f"model_type '{model_type}' already has an architecture entry; pass exist_ok=True to replace it"
        )
    if isinstance(entry, Architecture):
        _validate(entry)
    elif not callable(entry):
        raise TypeError(f"register_architecture needs an Architecture or a function of the config, got {entry!r}")
    ARCHITECTURES[model_type] = entry


def _validate(arch: Architecture) -> None:
    for site in arch.sites:
        if site.kind not in ("input", "per_head", "output"):
            raise ValueError(
                f"{arch.model_type}: site '{site.path}' has kind {site.kind!r}; use input, per_head or output"
            )
        if site.role not in SITE_ROLES:
            raise ValueError(f"{arch.model_type}: site '{site.path}' has role {site.role!r}; use one of {SITE_ROLES}")
        if not site.consumers:
            raise ValueError(f"{arch.model_type}: site '{site.path}' names no consumer/producer module to fold into")


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def architecture_for(model_type: str, config: Any = None) -> Architecture:
    """The table entry for ``model_type``; entries whose layout depends on the config need ``config``.

    Raises :class:`UnsupportedModelError` for a model type without an entry (``patch_model`` then tries
    discovery) and for configurations the entry refuses (e.g. post-LN OPT), with the reason.
    """
    try:
        entry = ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type '{model_type}' is not supported by hf_tapernorm; supported model types: "
            f"{', '.join(supported_model_types())}"
        ) from None
    if isinstance(entry, Architecture):
        return entry
    if config is None:
        raise UnsupportedModelError(
            f"the norm layout of model_type '{model_type}' depends on its config; pass config=model.config"
        )
    arch = entry(config)
    _validate(arch)
    return arch


__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "NormSite",
    "SITE_ROLES",
    "architecture_for",
    "register_architecture",
    "supported_model_types",
]
