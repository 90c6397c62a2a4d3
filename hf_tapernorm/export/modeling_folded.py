"""Norm-free ("folded") versions of supported causal LMs, loadable without hf_tapernorm.

This file is copied next to every exported checkpoint and loaded by
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` where hf_tapernorm is not
installed, so it imports only torch and transformers (huggingface_hub, a transformers dependency,
is imported lazily for ``push_to_hub``).

A folded model is the base architecture with the folded norms replaced by ``nn.Identity`` and a
zero bias added to the projections that absorbed a LayerNorm beta; weights keep their usual names
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

import os
import tempfile
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch
from torch import nn
from transformers import initialization as init


@dataclass(kw_only=True)
class FoldedConfigFields:
    """What folding did to the base architecture; read by the model class to rebuild it.

    Paths are module paths relative to the ``*ForCausalLM`` model.
    """

    base_model_type: str = ""
    final_norm: str = ""  # path of the base model's final norm (folded, kept or scaled)
    folded_norms: list[str] = field(default_factory=list)  # replaced by nn.Identity
    kept_norms: list[str] = field(default_factory=list)  # real norms of the base class
    scaled_norms: list[str] = field(default_factory=list)  # replaced by an explicit FoldedChannelScale
    added_biases: list[str] = field(default_factory=list)  # projections that gained a bias
    centred_norms: bool = False  # LayerNorm family: an explicit scale also centres, and has a bias
    tied_head: Optional[str] = None  # "untie" | "scale" when a tapered final norm met tied embeddings
    # Attention-sink prefix (hf_tapernorm/layers/sink.py): the token ids every training sequence started with,
    # and the shape [layers, kv_heads, n, head_dim] of their stored keys/values (buffers sink_keys/values).
    sink_token_ids: list[int] = field(default_factory=list)
    sink_cache_shape: list[int] = field(default_factory=list)
    # [n, vocab]: the logits at the sink positions (constants too), returned when the input starts with the sink.
    sink_logits_shape: list[int] = field(default_factory=list)
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


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def _sink_columns(model: nn.Module, kwargs: dict) -> Optional[torch.Tensor]:
    """Columns ``[batch, n]`` of a leading sink in ``input_ids`` (at each row's first attended column), else None.

    A tokenizer that adds BOS puts the sink in the input itself; those tokens are then the stored ones.
    Every row starts with the sink or none does: a batch that mixes both has no single meaning. Text that
    itself starts with the sink id (an EOS sink after a document boundary) is read as starting with the
    sink, as the tapered model reads position 0: pass the sink first to say so without doubt.
    """
    ids = kwargs.get("input_ids")
    sink = model.config.sink_token_ids
    if ids is None or ids.dim() != 2 or ids.shape[1] < len(sink):
        return None
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2 and mask.shape[-1] == ids.shape[1]:
        start = mask.ne(0).int().argmax(dim=1)  # left padding: the first attended column
    else:
        start = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
    columns = (start[:, None] + torch.arange(len(sink), device=ids.device)).clamp(max=ids.shape[1] - 1)
    found = ids.gather(1, columns).eq(torch.tensor(sink, device=ids.device)).all(dim=1)
    if not bool(found.any()):
        return None
    if not bool(found.all()):
        raise ValueError(
            f"{type(model).__name__}: some rows of input_ids start with the sink token(s) {sink} and others do not; "
            "start every row with the sink (unambiguous, also when the sink id occurs in text), or none"
        )
    return columns


def _left_padding(kwargs: dict, length: int) -> Optional[torch.Tensor]:
    """Per-row count of leading masked columns of a 2D ``attention_mask`` (None without left padding)."""
    mask = kwargs.get("attention_mask")
    if mask is None or mask.dim() != 2 or mask.shape[-1] != length:
        return None
    start = mask.ne(0).int().argmax(dim=1)
    return start if bool(start.any()) else None


def _drop_columns(tensor: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``tensor[b, keep[b]]`` for a ``[batch, length, ...]`` tensor, keeping as many columns in every row."""
    if tensor.shape[0] != keep.shape[0]:
        tensor = tensor.expand(keep.shape[0], *tensor.shape[1:])
    return tensor[keep].view(keep.shape[0], -1, *tensor.shape[2:])


def _prepend_sink(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Give the forward the stored sink keys/values as the start of its cache, whichever way the caller passes state.

    - The cache comes as ``cache=`` or the older ``past_key_values=`` (transformers renames it; both are the same
      object here, so a decode step costs the same either way).
    - A fresh forward (no cache, or an empty one) either starts with the sink tokens, as a tokenizer that adds BOS
      gives them: those columns are dropped and stand for the stored ones (positions count from the sink, the
      returned logits include the sink's, stored as well); or it is the text alone: ``position_ids`` count from the
      first text token and a 2D ``attention_mask`` may leave out the sink's columns.
    - A continued cache already holds the sink. A 2D mask one sink shorter than cache + input marks a caller
      that counts without the sink (its positions are shifted); the cache remembers how it was started.
    - A compileable (static) cache is refused: its masks are built before this hook can put the sink in it.
    """
    if len(args) > 1:
        raise TypeError(
            f"{type(model).__name__} with a sink prefix takes its inputs by keyword (got {len(args)} positional)"
        )
    if args:
        kwargs["input_ids"], args = args[0], ()
    legacy = kwargs.pop("past_key_values", None)
    if legacy is not None:
        if kwargs.get("cache") is not None:
            raise TypeError(f"{type(model).__name__}: pass the cache once, as cache= (or the older past_key_values=)")
        kwargs["cache"] = legacy
    cache = kwargs.get("cache")
    if cache is not None and getattr(cache, "is_compileable", False):
        raise ValueError(
            f"{type(model).__name__} holds its attention sink as a cache prefix and cannot fill a static "
            f"({type(cache).__name__}) cache; use the default dynamic cache (generate() without "
            "cache_implementation='static', or cache=DynamicCache(config=model.config))"
        )
    inputs = kwargs.get("input_ids")
    if inputs is None:
        inputs = kwargs["inputs_embeds"]
    batch, length = inputs.shape[0], inputs.shape[1]
    n = model.sink_keys.shape[2]
    model._sink_cache_only = False
    model._sink_restore = None
    wants_tuple = kwargs.get("return_dict", getattr(model.config, "return_dict", True)) is False
    model._sink_wants_tuple = wants_tuple
    if wants_tuple:
        kwargs["return_dict"] = True  # the output hook edits a ModelOutput, then returns the tuple
    if cache is None or cache.get_seq_length() == 0:
        columns = _sink_columns(model, kwargs)
        padding = _left_padding(kwargs, length)
        offset = padding if kwargs.get("position_ids") is None else None
        order = None
        if columns is not None:
            order = _take_sink_from_input(model, kwargs, columns)
            batch, length = kwargs["input_ids"].shape
        if cache is None:
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            model._sink_cache_only = kwargs.get("use_cache", model.config.use_cache) is False
        dtype = model.get_input_embeddings().weight.dtype
        for index in range(model.sink_keys.shape[0]):
            keys = model.sink_keys[index].to(dtype).expand(batch, -1, -1, -1).contiguous()
            values = model.sink_values[index].to(dtype).expand(batch, -1, -1, -1).contiguous()
            cache.update(keys, values, index)
        cache.sink_in_input, cache.sink_row_offset = columns is not None, offset
        # Where each cache column came from in the caller's columns, when the sink was not in front of every row.
        cache.sink_mask_order = order if padding is not None else None
        kwargs["cache"], kwargs["use_cache"] = cache, True
        counts_without_sink, order = columns is None, None
    else:
        counts_without_sink = not getattr(cache, "sink_in_input", False)
        order = getattr(cache, "sink_mask_order", None)
    past = cache.get_seq_length()
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        counts_without_sink = mask.shape[-1] == past + length - n
        if counts_without_sink:
            kwargs["attention_mask"] = torch.cat([mask.new_ones(batch, n), mask], dim=-1)
        elif order is not None and mask.shape[0] == order.shape[0] and mask.shape[-1] >= order.shape[1]:
            # The caller's mask has each left-padded row's sink after its pads; the cache has it first.
            head = mask[:, : order.shape[1]].gather(1, order)
            kwargs["attention_mask"] = torch.cat([head, mask[:, order.shape[1] :]], dim=-1)
    positions = kwargs.get("position_ids")
    if positions is not None:
        if counts_without_sink:
            kwargs["position_ids"] = positions + n
    elif getattr(cache, "sink_row_offset", None) is not None and cache.sink_row_offset.shape[0] == batch:
        # Left padding without position_ids: each row counts from its own first token, as generate() does.
        steps = torch.arange(past, past + length, device=cache.sink_row_offset.device)
        kwargs["position_ids"] = steps[None, :] - cache.sink_row_offset[:, None]
    return args, kwargs


def _take_sink_from_input(model: nn.Module, kwargs: dict, columns: torch.Tensor) -> torch.Tensor:
    """Drop the sink's columns from a fresh forward's inputs; record how to put the sink's logits back.

    Returns the caller's column of every cache column (``[batch, length]``: the sink's first, then the rest).
    """
    ids = kwargs["input_ids"]
    batch, length = ids.shape
    n = columns.shape[1]
    if not hasattr(model, "sink_logits"):
        raise ValueError(
            f"{type(model).__name__}: input_ids start with the sink token(s) {model.config.sink_token_ids}, which "
            "this export (from an older hf_tapernorm) holds as stored keys/values only; pass the text without them "
            "(tokenizer(..., add_special_tokens=False)) or re-export the model"
        )
    keep = torch.ones_like(ids, dtype=torch.bool).scatter_(1, columns, False)
    kwargs["input_ids"] = _drop_columns(ids, keep)
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2 and mask.shape[-1] == length:
        kwargs["attention_mask"] = torch.cat([mask.new_ones(batch, n), _drop_columns(mask, keep)], dim=-1)
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=ids.device).expand(batch, -1)
    if positions.dim() == 2:
        positions = positions.expand(batch, -1) if positions.shape[0] != batch else positions
        # The stored keys sit at positions 0..n-1: each row counts from its own first sink token.
        kwargs["position_ids"] = _drop_columns(positions - positions.gather(1, columns[:, :1]), keep)
    labels = kwargs.pop("labels", None)
    keep_logits = kwargs.get("logits_to_keep", 0)
    # The last k columns come out of the model unchanged when no row's sink is among them.
    passes = isinstance(keep_logits, int) and keep_logits > 0 and length - keep_logits > int(columns.max())
    if not passes:
        kwargs["logits_to_keep"] = 0
    model._sink_restore = (keep, None if passes else keep_logits, labels)
    kept = torch.arange(length, device=ids.device).expand(batch, -1)[keep].view(batch, -1)
    return torch.cat([columns, kept], dim=1)


def _finish_sink_output(model: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """Put the sink's stored logits back in their columns, compute a loss on the full sequence, honour the
    caller's ``use_cache=False`` and ``return_dict=False``."""
    if model._sink_restore is not None:
        keep, keep_logits, labels = model._sink_restore
        model._sink_restore = None
        if keep_logits is not None:
            logits = output.logits
            full = logits.new_empty(*keep.shape, logits.shape[-1])
            full[keep] = logits.reshape(-1, logits.shape[-1])
            full[~keep] = model.sink_logits.to(logits.dtype).repeat(keep.shape[0], 1)
            if isinstance(keep_logits, int):
                full = full[:, -keep_logits:] if keep_logits > 0 else full
            else:
                full = full[:, keep_logits]
            output["logits"] = full
        if labels is not None:
            loss_kwargs = {key: kwargs[key] for key in ("num_items_in_batch", "ignore_index") if key in kwargs}
            output["loss"] = model.loss_function(
                logits=output.logits, labels=labels, vocab_size=model.config.vocab_size, **loss_kwargs
            )
    if model._sink_cache_only and getattr(output, "cache", None) is not None:
        output["cache"] = None  # item, not attribute: ModelOutput ignores setting an attribute to None
    if model._sink_wants_tuple:  # in field order, as ModelOutput.to_tuple gives it, without the None fields
        return tuple(getattr(output, item.name) for item in fields(output) if getattr(output, item.name) is not None)
    return output


class FoldedModelMixin:
    """Rebuilds the folded structure from the config, loads strictly, and carries the model card."""

    model_card: Optional[str] = None  # README.md text written next to the weights when set

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self._apply_fold_structure()

    def _apply_fold_structure(self) -> None:
        config = self.config
        for path in config.folded_norms:
            _set_submodule(self, path, nn.Identity())
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
            if config.sink_logits_shape:
                self.register_buffer("sink_logits", torch.zeros(config.sink_logits_shape))
            self.register_forward_pre_hook(_prepend_sink, with_kwargs=True)
            self.register_forward_hook(_finish_sink_output, with_kwargs=True)

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
PREFIX = "tapernorm_"


def _base_type(config_class: type) -> str:
    return config_class.model_type[len(PREFIX) :]


def _post_init(self, **kwargs: Any) -> None:
    """The base config's ``__post_init__``, then make the folded model class loadable through the Auto classes."""
    for base in type(self).__mro__[1:]:
        if "__post_init__" in base.__dict__:
            base.__dict__["__post_init__"](self, **kwargs)
            break
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.register(type(self), folded_model_class(_base_type(type(self))), exist_ok=True)


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
            {"config_class": folded_config_class(base_model_type), "__module__": __name__},
        )
        model_class.register_for_auto_class("AutoModelForCausalLM")
        _MODEL_CLASSES[base_model_type] = model_class
    return _MODEL_CLASSES[base_model_type]


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
