"""One declarative table: which modules of each architecture are norms, and who reads them.

Patching uses it to find the norms; folding uses the same entries to know which projections absorb
each tapered norm. Paths are relative to one decoder layer (``sites``) or to the base model
(``final_norm``); ``lm_head`` (the module that reads the final norm: the head, or OPT's
``project_out``) is relative to the ``*ForCausalLM`` wrapper. Architectures without an entry are
described by ``discovery.discover_architecture`` instead, in the same terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

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
# q_norm/k_norm act on each head of the q/k projections before RoPE: they fold into those output rows.
_QK_NORM_SITES = (
    NormSite("self_attn.q_norm", ("self_attn.q_proj",), "per_head"),
    NormSite("self_attn.k_norm", ("self_attn.k_proj",), "per_head"),
)
# Gemma 2/3: a pre-norm and a post-norm around each branch; the post-norms scale the branch outputs.
_GEMMA2_SITES = (
    NormSite("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    NormSite("post_attention_layernorm", ("self_attn.o_proj",), "output"),
    NormSite("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    NormSite("post_feedforward_layernorm", ("mlp.down_proj",), "output"),
)


def _phi(config: Any) -> Architecture:
    # One shared pre-norm feeds attention AND the MLP (parallel block); optional per-head q/k LayerNorms.
    sites = (NormSite("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc1")),)
    if getattr(config, "qk_layernorm", False):
        sites += (
            NormSite("self_attn.q_layernorm", ("self_attn.q_proj",), "per_head"),
            NormSite("self_attn.k_layernorm", ("self_attn.k_proj",), "per_head"),
        )
    return Architecture("phi", NormStyle.LAYER, "layers", sites, "final_layernorm")


def _opt(config: Any) -> Architecture:
    if not config.do_layer_norm_before:
        raise ValueError(
            "OPT with do_layer_norm_before=False (post-LN, e.g. facebook/opt-350m) is not supported: its norms "
            "sit on the residual stream after each block, where nothing linear can absorb them; TaperNorm "
            "folding covers pre-norm models only"
        )
    if config._remove_final_layer_norm:
        raise ValueError(
            "OPT with _remove_final_layer_norm=True has no final norm; hf_tapernorm needs the final norm "
            "(it anchors the output scale)"
        )
    sites = (
        NormSite("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        NormSite("final_layer_norm", ("fc1",)),
    )
    # With word_embed_proj_dim != hidden_size the final norm feeds project_out, not lm_head.
    head = "model.decoder.project_out" if config.word_embed_proj_dim != config.hidden_size else "lm_head"
    return Architecture("opt", NormStyle.LAYER, "decoder.layers", sites, "decoder.final_layer_norm", head)


def _falcon(config: Any) -> Architecture:
    # Three layouts, chosen exactly as FalconDecoderLayer.forward chooses them.
    qkv, fc = "self_attention.query_key_value", "mlp.dense_h_to_4h"
    num_ln = config.num_ln_in_parallel_attn
    if config.new_decoder_architecture and num_ln in (None, 2):
        sites = (NormSite("ln_attn", (qkv,)), NormSite("ln_mlp", (fc,)))  # parallel block, two norms
    elif config.new_decoder_architecture or config.parallel_attn:
        sites = (NormSite("input_layernorm", (qkv, fc)),)  # parallel block, one shared norm
    else:
        sites = (NormSite("input_layernorm", (qkv,)), NormSite("post_attention_layernorm", (fc,)))  # sequential
    return Architecture("falcon", NormStyle.LAYER, "h", sites, "ln_f")


# A value is either an Architecture or, where the layout depends on the config, a function of the config.
ARCHITECTURES: dict[str, Union[Architecture, Callable[[Any], Architecture]]] = {
    "llama": Architecture("llama", NormStyle.RMS, "layers", _LLAMA_SITES, "norm"),
    "mistral": Architecture("mistral", NormStyle.RMS, "layers", _LLAMA_SITES, "norm"),
    "qwen2": Architecture("qwen2", NormStyle.RMS, "layers", _LLAMA_SITES, "norm"),
    "qwen3": Architecture("qwen3", NormStyle.RMS, "layers", _QK_NORM_SITES + _LLAMA_SITES, "norm"),
    "gemma": Architecture("gemma", NormStyle.RMS_OFFSET, "layers", _LLAMA_SITES, "norm"),
    "gemma2": Architecture("gemma2", NormStyle.RMS_OFFSET, "layers", _GEMMA2_SITES, "norm"),
    "gemma3_text": Architecture("gemma3_text", NormStyle.RMS_OFFSET, "layers", _QK_NORM_SITES + _GEMMA2_SITES, "norm"),
    "phi": _phi,
    "phi3": Architecture(
        "phi3",
        NormStyle.RMS,
        "layers",
        (
            NormSite("input_layernorm", ("self_attn.qkv_proj",)),  # fused q/k/v
            NormSite("post_attention_layernorm", ("mlp.gate_up_proj",)),  # fused gate/up
        ),
        "norm",
    ),
    "gpt_neox": Architecture(
        "gpt_neox",
        NormStyle.LAYER,
        "layers",
        # Both norms read the layer input when use_parallel_residual=True; their consumers are the same either way.
        (
            NormSite("input_layernorm", ("attention.query_key_value",)),
            NormSite("post_attention_layernorm", ("mlp.dense_h_to_4h",)),
        ),
        "final_layer_norm",
    ),
    "opt": _opt,
    "falcon": _falcon,
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


def architecture_for(model_type: str, config: Any = None) -> Architecture:
    """The table entry for ``model_type``; entries whose layout depends on the config need ``config``.

    Raises ``ValueError`` for a model type without an entry (``patch_model`` then tries discovery) and
    for configurations the entry refuses (e.g. post-LN OPT), with the reason.
    """
    try:
        entry = ARCHITECTURES[model_type]
    except KeyError:
        raise ValueError(
            f"model_type '{model_type}' is not supported by hf_tapernorm; supported model types: "
            f"{', '.join(supported_model_types())}"
        ) from None
    if isinstance(entry, Architecture):
        return entry
    if config is None:
        raise ValueError(
            f"the norm layout of model_type '{model_type}' depends on its config; pass config=model.config"
        )
    return entry(config)
