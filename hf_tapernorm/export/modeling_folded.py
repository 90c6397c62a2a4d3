"""Norm-free ("folded") versions of supported causal LMs, loadable without hf_tapernorm.

This file, ``folded_sink.py`` (the attention-sink prefix, imported relatively) and ``folded_input.py`` (how the
sink export reads its input, imported by ``folded_sink.py``) are copied next to every exported checkpoint and loaded
by ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` where hf_tapernorm is not installed, so
they import only torch and transformers (huggingface_hub, a transformers dependency, is imported lazily for
``push_to_hub``).

A folded model is the base architecture with the folded norms replaced by ``nn.Identity`` and a
zero bias added to the projections that absorbed a LayerNorm beta; a kept norm whose weight was folded into
the modules it feeds (FlashNorm) is weightless (``weightless_norms``). Weights keep their usual names
(``model.layers.0.self_attn.q_proj.weight``), so generation, the KV cache, ``dtype=`` and
``device_map`` behave exactly as for the base model. The config records what was folded, so the
same structure is rebuilt on load. Every family gets its two classes from transformers' own, built
on first use and named ``TaperNorm`` + the base class name (``TaperNormLlamaConfig``,
``TaperNormLlamaForCausalLM``); the module-level ``__getattr__`` builds them on demand, so
``auto_map`` names resolve under trust_remote_code too. Building a config class imports only the
family's configuration module; its model class (and modeling module) is built, and registered with
``AutoModelForCausalLM``, when the first config of that family is instantiated.
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from transformers import initialization as init

from .folded_input import check_plain_call, learned_positions
from .folded_sink import PREFIX, attention_modules, finish_sink_call, give_back_sink_cache, prepare_sink_call

RESTORE_CONFIG = "restore the config.json the export wrote"  # ends every refusal of an edited config.json


@dataclass(kw_only=True)
class FoldedConfigFields:
    """What folding did to the base architecture; read by the model class to rebuild it.

    Paths are module paths relative to the ``*ForCausalLM`` model.
    """

    base_model_type: str = ""
    final_norm: str = ""  # path of the base model's final norm (folded, kept or scaled)
    folded_norms: list[str] = field(default_factory=list)  # replaced by nn.Identity
    kept_norms: list[str] = field(default_factory=list)  # real norms of the base class
    # Kept norms whose weight (and LayerNorm bias) was folded into the modules they feed (FlashNorm): path -> eps.
    # Each is a weightless norm (WeightlessRMSNorm, or a LayerNorm without affine); absent in older exports,
    # whose kept norms keep their weights.
    weightless_norms: dict[str, float] = field(default_factory=dict)
    scaled_norms: list[str] = field(default_factory=list)  # replaced by an explicit FoldedChannelScale
    added_biases: list[str] = field(default_factory=list)  # projections that gained a bias
    centred_norms: bool = False  # LayerNorm family: an explicit scale also centres, and has a bias
    tied_head: Optional[str] = None  # "untie" | "scale" when a tapered final norm met tied embeddings
    # Attention-sink prefix (hf_tapernorm/layers/sink.py): the token ids every training sequence started with,
    # and the shape [layers, kv_heads, n, head_dim] of their stored keys/values (buffers sink_keys/values).
    sink_token_ids: list[int] = field(default_factory=list)
    sink_cache_shape: list[int] = field(default_factory=list)
    # [n, vocab]: the logits at the sink positions (constants too), returned when the input starts with the sink;
    # with them, the sink's hidden states [entries, n, hidden] and attention rows [layers, heads, n, n] (absent in
    # older exports: NaN there).
    sink_logits_shape: list[int] = field(default_factory=list)
    sink_hidden_states_shape: list[int] = field(default_factory=list)
    sink_attentions_shape: list[int] = field(default_factory=list)
    # With a learned position table: its size, which the stored sink's positions count against (0: no table).
    sink_max_positions: int = 0
    hf_tapernorm_version: str = ""
    tapernorm_config: dict = field(default_factory=dict)  # the TaperNormConfig of the run (to_dict)


class FoldedChannelScale(nn.Module):
    """The explicit per-channel map kept where a tapered final norm meets a tied head (``tied_head="scale"``).

    Computes ``h * weight`` (RMS family) or ``(h - mean(h)) * weight + bias`` (LayerNorm family):
    no per-token statistic beyond the (linear) centring. Its name avoids "Norm" on purpose, so the
    generic transformers initialisation does not treat it as a norm.
    """

    def __init__(self, hidden_size: int, *, centred: bool) -> None:
        super().__init__()
        self.centred = centred
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if centred else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.centred:
            hidden_states = hidden_states - hidden_states.mean(-1, keepdim=True)
            return hidden_states * self.weight + self.bias
        return hidden_states * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, centred={self.centred}"


class WeightlessRMSNorm(nn.Module):
    """A kept RMS norm whose weight was folded into the modules it feeds (FlashNorm): ``x * rsqrt(mean(x^2) + eps)``.

    The statistic in fp32, then the cast back, exactly as Llama's RMSNorm computes it before multiplying by its
    weight (Gemma's ``1 + w`` too): one operation fewer per norm and token, the same outputs.
    """

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"eps={self.variance_epsilon}"


def _weightless_norm(norm: nn.Module, eps: float, centred: bool) -> nn.Module:
    """The weightless replacement of a kept norm: a LayerNorm without affine (centred family) or WeightlessRMSNorm."""
    if not centred:
        return WeightlessRMSNorm(eps)
    reference = norm.weight if getattr(norm, "weight", None) is not None else norm.bias
    return nn.LayerNorm(reference.shape[-1], eps=eps, elementwise_affine=False)


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


class FoldedModelMixin:
    """Rebuilds the folded structure from the config, loads strictly, and carries the model card."""

    model_card: Optional[str] = None  # README.md text written next to the weights when set

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self._apply_fold_structure()
        self.position_table_size = 0 if config.sink_token_ids else learned_positions(self)  # a sink's: read_input's

    def _apply_fold_structure(self) -> None:
        config = self.config
        for field_name in ("folded_norms", "scaled_norms", "weightless_norms", "added_biases"):
            for path in getattr(config, field_name):
                try:
                    self.get_submodule(path)
                except AttributeError:
                    raise ValueError(
                        f"{type(self).__name__}: config.json's {field_name} names {path}, which this architecture "
                        f"lacks (num_hidden_layers={getattr(config, 'num_hidden_layers', '?')}): the config was edited "
                        f"or belongs to another export; {RESTORE_CONFIG}"
                    ) from None
        for path in config.folded_norms:
            _set_submodule(self, path, nn.Identity())
        for path, eps in config.weightless_norms.items():
            _set_submodule(self, path, _weightless_norm(self.get_submodule(path), eps, config.centred_norms))
        for path in config.scaled_norms:
            norm = self.get_submodule(path)
            reference = getattr(norm, "weight", None)
            hidden = reference.shape[-1] if reference is not None else config.hidden_size
            scale = FoldedChannelScale(hidden, centred=config.centred_norms)
            if reference is not None:
                scale.to(device=reference.device, dtype=reference.dtype)
            _set_submodule(self, path, scale)
        for path in config.added_biases:
            module = self.get_submodule(path)
            if getattr(module, "bias", None) is None:
                weight = module.weight
                out_features = weight.shape[0] if isinstance(module, nn.Linear) else weight.shape[1]
                module.bias = nn.Parameter(torch.zeros(out_features, dtype=weight.dtype, device=weight.device))
        if config.sink_token_ids:
            self.register_buffer("sink_keys", torch.zeros(config.sink_cache_shape))
            self.register_buffer("sink_values", torch.zeros(config.sink_cache_shape))
            for name in ("logits", "hidden_states", "attentions"):
                shape = getattr(config, f"sink_{name}_shape")
                if shape:
                    self.register_buffer(f"sink_{name}", torch.zeros(shape))
            for module in attention_modules(self):  # under gradient checkpointing: folded_sink.SinkPrefixCache
                module.register_forward_pre_hook(give_back_sink_cache, with_kwargs=True)

    def prepare_inputs_for_generation(
        self, input_ids: torch.LongTensor, *args: Any, inputs_embeds: Optional[torch.Tensor] = None, **kwargs: Any
    ) -> dict:
        """transformers' own, counting a continued sink cache without its stored sink.

        ``generate(ids, cache=previous)`` slices off the tokens the cache already holds, ``len(ids)`` minus the
        cache's length; a cache this model started without the sink in the input holds the sink too, so the
        slice would drop the last generated token(s). Decode steps (one new token) are left as they are.
        ``inputs_embeds`` is named so that ``generate(inputs_embeds=...)`` sees it is forwarded (transformers
        refuses a model whose signature lacks it), as the base model's own does.
        """
        cache = kwargs.get("cache")
        length = kwargs.get("next_sequence_length")
        restarted = cache is not None and length is not None and length != 1
        restarted = restarted and getattr(getattr(cache, "sink_state", None), "in_input", True) is False
        if self.config.sink_token_ids and restarted and length == input_ids.shape[1] - cache.get_seq_length():
            kwargs["next_sequence_length"] = length + self.sink_keys.shape[2]
        return super().prepare_inputs_for_generation(input_ids, *args, inputs_embeds=inputs_embeds, **kwargs)

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> nn.Embedding:
        """``PreTrainedModel.resize_token_embeddings``, with the stored sink logits resized to the new vocabulary.

        The sink's final hidden state is recovered from its stored logits (least squares through the old head,
        exact while the head has full column rank) and read by the new head, so a new token's logit at the
        sink is what the model would compute.
        """
        sink_logits = getattr(self, "sink_logits", None)
        old_head = self.get_output_embeddings()
        old_weight = old_head.weight.detach().to(torch.float64).clone() if sink_logits is not None else None
        old_bias = getattr(old_head, "bias", None)
        old_bias = (
            old_bias.detach().to(torch.float64).clone() if sink_logits is not None and old_bias is not None else None
        )
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        if sink_logits is not None:
            head = self.get_output_embeddings()
            target = sink_logits.to(torch.float64) - (old_bias if old_bias is not None else 0.0)
            hidden = torch.linalg.lstsq(old_weight, target.T).solution.T  # [n, hidden]
            logits = hidden @ head.weight.detach().to(torch.float64).T
            if getattr(head, "bias", None) is not None:
                logits = logits + head.bias.detach().to(torch.float64)
            self.sink_logits = logits.to(sink_logits.dtype)
            self.config.sink_logits_shape = list(self.sink_logits.shape)
        return embeddings

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, FoldedChannelScale):
            init.ones_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        """``PreTrainedModel.from_pretrained`` that refuses incomplete or mismatched weights.

        transformers only warns about missing keys and initialises them randomly; for a folded
        model that would be a silently broken network, so any missing, unexpected or mismatched
        weight is an error.
        """
        want_info = kwargs.pop("output_loading_info", False)
        source = args[0] if args and args[0] is not None else "the given state_dict"
        try:
            model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        except Exception as error:  # noqa: BLE001 - safetensors and torch raise their own types; re-raised unless known
            text = str(error)
            if "config.json's" in text and RESTORE_CONFIG in text:
                raise OSError(f"{source}: {text}") from None
            if "ignore_mismatched_sizes" in text or "size mismatch" in text:
                raise OSError(
                    f"{cls.__name__}: a tensor in {source} has another shape than the folded architecture declares "
                    f"({text.splitlines()[0][:300]}). The file was modified or belongs to another model; re-export it "
                    "with hf_tapernorm"
                ) from None
            if type(error).__name__ == "SafetensorError" or "deserializ" in text or "header" in text.lower():
                raise OSError(
                    f"{cls.__name__}: cannot read the weights in {source}: {type(error).__name__}: {text[:300]}. The "
                    "file is truncated or not a safetensors file; copy or re-export it"
                ) from None
            raise
        problems = {
            key: sorted(str(item) for item in info.get(key) or ())
            for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
        }
        problems = {key: value for key, value in problems.items() if value}
        if problems:
            details = "; ".join(
                f"{key}: {', '.join(value[:8])}{' ...' if len(value) > 8 else ''}" for key, value in problems.items()
            )
            raise OSError(
                f"{cls.__name__}: the weights in {source} do not match the folded architecture ({details}). "
                "A folded checkpoint must load completely; re-export it with hf_tapernorm instead of using "
                "a partially initialised model."
            )
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True, **kwargs: Any) -> None:
        """``PreTrainedModel.save_pretrained`` plus README.md when a model card is attached."""
        super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        if is_main_process and self.model_card is not None:
            with open(os.path.join(save_directory, "README.md"), "w", encoding="utf-8") as handle:
                handle.write(self.model_card)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: Optional[str] = None,
        commit_description: Optional[str] = None,
        private: Optional[bool] = None,
        token: Optional[str | bool] = None,
        revision: Optional[str] = None,
        create_pr: bool = False,
        max_shard_size: int | str = "50GB",
        **kwargs: Any,
    ):
        """Upload exactly what ``save_pretrained`` writes (weights, config, code, README.md).

        Without an attached model card this is transformers' own ``push_to_hub``; with one, the card
        is uploaded as README.md instead of the generic card transformers would write over it.
        """
        if self.model_card is None:
            return super().push_to_hub(
                repo_id,
                commit_message=commit_message,
                commit_description=commit_description,
                private=private,
                token=token,
                revision=revision,
                create_pr=create_pr,
                max_shard_size=max_shard_size,
                **kwargs,
            )
        if kwargs:
            raise TypeError(f"push_to_hub got unexpected arguments: {', '.join(sorted(kwargs))}")
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, max_shard_size=max_shard_size)
            return upload_export(
                folder,
                repo_id,
                token=token,
                private=private,
                commit_message=commit_message,
                commit_description=commit_description,
                revision=revision,
                create_pr=create_pr,
            )


def upload_export(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    token: Optional[str | bool] = None,
    private: Optional[bool] = None,
    commit_message: Optional[str] = None,
    commit_description: Optional[str] = None,
    revision: Optional[str] = None,
    create_pr: bool = False,
    allow_patterns: Optional[list[str]] = None,
):
    """Create ``repo_id`` if needed and upload ``folder`` (only ``allow_patterns`` when given); returns the commit.

    The one push path: ``FoldedModelMixin.push_to_hub`` and ``hf-tapernorm push`` both end here.
    """
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        commit_message=commit_message or "Upload norm-free model folded with hf_tapernorm",
        commit_description=commit_description,
        revision=revision,
        create_pr=create_pr,
        repo_type="model",
        allow_patterns=allow_patterns,
    )


# ---------------------------------------------------------------------------------------- families
_CONFIG_CLASSES: dict[str, type] = {}  # base model_type -> folded config class
_MODEL_CLASSES: dict[str, type] = {}  # base model_type -> folded causal-LM class


def _base_type(config_class: type) -> str:
    return config_class.model_type[len(PREFIX) :]


def _post_init(self, **kwargs: Any) -> None:
    """The base config's ``__post_init__``, then make the folded model class loadable through the Auto classes."""
    for base in type(self).__mro__[1:]:
        if "__post_init__" in base.__dict__:
            base.__dict__["__post_init__"](self, **kwargs)
            break
    _check_sink_token_ids(self)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.register(type(self), folded_model_class(_base_type(type(self))), exist_ok=True)


def _check_sink_token_ids(config: Any) -> None:
    """Refuse a ``sink_token_ids`` that is not a list of integer ids when the config is built or loaded.

    An edited config.json ("127", 127, "[127]", [127.0]) would otherwise load and fail at the first forward, deep in
    folded_input.py; this file cannot import hf_tapernorm's own id reading (it runs where hf_tapernorm is absent).
    """
    ids = config.sink_token_ids
    if not (
        isinstance(ids, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise ValueError(
            f"{type(config).__name__}: config.json's sink_token_ids is {ids!r}, not a list of integer token ids; "
            f"write them as a list such as [1], or {RESTORE_CONFIG}"
        )
    _check_sink_against_stored(config, list(ids))


def _check_sink_against_stored(config: Any, ids: list[int]) -> None:
    """Refuse sink ids the stored sink cannot be (another count than ``sink_cache_shape``'s positions, none included,
    an id past the vocabulary, other ids than its recipe's): an edited config.json failed, or took 5 as 127's sink."""
    shape = config.sink_cache_shape
    if isinstance(shape, (list, tuple)) and len(shape) == 4 and len(ids) != shape[2]:
        named = f"'s sink_token_ids {ids} name {len(ids)} token(s)" if ids else " names no sink_token_ids"
        raise ValueError(
            f"{type(config).__name__}: config.json{named}, but the stored sink (sink_cache_shape {list(shape)}) holds "
            f"{shape[2]} position(s); {RESTORE_CONFIG}"
        )
    vocab = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "vocab_size", None)
    unknown = [i for i in ids if isinstance(vocab, int) and i >= vocab]
    if unknown:
        raise ValueError(
            f"{type(config).__name__}: config.json's sink_token_ids {ids} name {unknown[0]}, past the vocabulary of "
            f"{vocab} tokens; {RESTORE_CONFIG}"
        )
    recipe = getattr(config, "tapernorm_config", None)  # the recipe the stored sink was computed under
    trained = recipe.get("sink_token_ids") if isinstance(recipe, dict) else None
    if ids and isinstance(trained, list) and ids != trained:
        raise ValueError(
            f"{type(config).__name__}: config.json's sink_token_ids {ids} are not the sink {trained} the stored sink "
            f"was computed for (its tapernorm_config); {RESTORE_CONFIG}"
        )


def folded_config_class(base_model_type: str) -> type:
    """The folded config class of ``base_model_type`` (imports only that family's configuration module)."""
    if base_model_type not in _CONFIG_CLASSES:
        from transformers import CONFIG_MAPPING

        try:
            base_config = CONFIG_MAPPING[base_model_type]
        except KeyError:
            raise ValueError(f"transformers has no config class for model_type '{base_model_type}'") from None
        config_class = type(
            f"TaperNorm{base_config.__name__}",
            (base_config, FoldedConfigFields),
            {"model_type": f"{PREFIX}{base_model_type}", "__module__": __name__, "__post_init__": _post_init},
        )
        config_class.register_for_auto_class("AutoConfig")
        _CONFIG_CLASSES[base_model_type] = config_class
    return _CONFIG_CLASSES[base_model_type]


def folded_model_class(base_model_type: str) -> type:
    """The folded causal-LM class of ``base_model_type``: the family's ``*ForCausalLM`` with the fold structure."""
    if base_model_type not in _MODEL_CLASSES:
        from transformers import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        try:
            base_model = MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[base_model_type]]
        except KeyError:
            raise ValueError(
                f"transformers has no causal-LM class for model_type '{base_model_type}', so there is no folded "
                "model class for it"
            ) from None
        model_class = type(
            f"TaperNorm{base_model.__name__}",
            (FoldedModelMixin, base_model),
            {
                "config_class": folded_config_class(base_model_type),
                "__module__": __name__,
                "forward": _sink_forward(base_model.forward),
            },
        )
        model_class.register_for_auto_class("AutoModelForCausalLM")
        _MODEL_CLASSES[base_model_type] = model_class
    return _MODEL_CLASSES[base_model_type]


def _sink_forward(base_forward):
    """The base class's forward, with the stored sink put in front of a fresh cache (folded_sink.py) when the
    config has one; ``functools.wraps`` keeps its signature, which transformers inspects."""

    @functools.wraps(base_forward)
    def forward(self, *args: Any, **kwargs: Any):
        if not self.config.sink_token_ids:
            if self.position_table_size:  # a learned table (GPT-2): refused past it as a sink export is, in one line
                check_plain_call(self, self.position_table_size, args, kwargs)
            return base_forward(self, *args, **kwargs)
        args, kwargs, call = prepare_sink_call(self, args, kwargs)
        return finish_sink_call(self, kwargs, base_forward(self, *args, **kwargs), call)

    return forward


def folded_classes(base_model_type: str) -> tuple[type, type]:
    """(folded config class, folded causal-LM class) for ``base_model_type``, built on first use."""
    return folded_config_class(base_model_type), folded_model_class(base_model_type)


def __getattr__(name: str) -> type:
    """Resolve ``TaperNorm<BaseClass>`` names (PEP 562): an exported ``auto_map`` names a built-on-use class."""
    if name.startswith("TaperNorm"):
        import transformers

        base = getattr(transformers, name[len("TaperNorm") :], None)
        if isinstance(base, type):
            is_config = hasattr(base, "model_type") and not hasattr(base, "config_class")
            model_type = getattr(base if is_config else getattr(base, "config_class", None), "model_type", None)
            if isinstance(model_type, str) and model_type:
                built = folded_config_class(model_type) if is_config else folded_model_class(model_type)
                if built.__name__ == name:
                    return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
