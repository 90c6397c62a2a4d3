"""The sink-attention term: keep the tapered model's heads sending their attention to the sink.

Pretrained Llama-family models park most of each head's attention on the first token (the attention
sink), which the recipe keeps normalized. Where a tapered model breaks on an input, its heads stop doing
that: the sink's share of attention falls in the middle layers, every head mixes content into every
position, and the residual stream runs away layer after layer (docs/fidelity.md, "What breaks"). The
distillation KL sees only the output distribution, so nothing else in the recipe asks the model to keep
that mechanism. This term does.

For every layer, head and query position after the sink, the share of attention on the sink tokens is a
Bernoulli probability; the term is ``weight * KL(teacher share || student share)``, averaged over layers
and heads, summed over query positions and counted per position like the distillation KL. The teacher is
the distillation's teacher, whose attentions come from the forward the distillation runs anyway: the term
costs no extra forward. It is 0 whenever the distillation term is (before the teacher exists, after it is
released).

Both forwards need each query's attention on the sink, which sdpa does not return. Eager attention returns
every weight, a (queries x keys) matrix per layer and head kept for the backward: memory grows with the
square of the length. So the training forwards run an attention of their own, registered with
transformers' ``AttentionInterface``: sdpa for the output, and sdpa once more with values that mark the sink
positions (a one-hot per sink token), whose output is exactly the attention each query gives each sink token.
Memory stays linear in the length, and the shares are sdpa's own, differentiable like the output. Models sdpa
cannot serve (a logit soft-cap, no sdpa support, attention not dispatched through the interface) fall back
to eager attention.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ..errors import ConfigurationError
from ..layers.loss_terms import ForwardInputs, add_training_loss_term, remove_training_loss_term

logger = logging.getLogger(__name__)

_TERM = "sink_attention"
#: The attention implementation that returns every attention weight (sdpa and flash kernels return none).
EAGER = "eager"


def sink_shares(attentions: Sequence[torch.Tensor], sink_length: int = 1) -> torch.Tensor:
    """The share of attention each query after the sink gives the sink tokens: (layers, batch, heads, queries), fp32."""
    return torch.stack([layer[:, :, sink_length:, :sink_length].float().sum(-1) for layer in attentions])


def bernoulli_kl(teacher: torch.Tensor, student: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """KL(Bernoulli(teacher) || Bernoulli(student)), elementwise; probabilities clamped to [eps, 1 - eps]."""
    p = teacher.clamp(eps, 1 - eps)
    q = student.clamp(eps, 1 - eps)
    return p * (p.log() - q.log()) + (1 - p) * ((1 - p).log() - (1 - q).log())


def sink_share_attention(sink_length: int) -> str:
    """The name of the attention that reports each query's attention on the first ``sink_length`` keys
    (registered with transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` on first use).

    Its weights output is (batch, heads, queries, sink_length): the columns of the sink tokens, which is
    what :func:`sink_shares` reads from eager attention's full weights too.
    """
    name = f"tapernorm_sink_share_{sink_length}"
    AttentionInterface.register(name, _sink_share_forward(sink_length))  # registering again replaces it
    AttentionMaskInterface.register(name, sdpa_mask)  # the masks sdpa reads
    return name


def _sink_share_forward(sink_length: int):
    def forward(module: nn.Module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("output_attentions", None)  # answered below, not by sdpa
        output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        marker = torch.zeros_like(value)  # (batch, kv heads, keys, head dim): channel j is 1 at sink token j
        marker[:, :, :sink_length, :sink_length] = torch.eye(sink_length, dtype=value.dtype, device=value.device)
        on_sink, _ = sdpa_attention_forward(module, query, key, marker, attention_mask, **{**kwargs, "dropout": 0.0})
        return output, on_sink[..., :sink_length].transpose(1, 2)  # sdpa's output is (batch, queries, heads, dim)

    return forward


def _current_attention(model: nn.Module) -> Optional[str]:
    # transformers has a public setter (set_attn_implementation) but reads the current one only from this property.
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def _sdpa_can_serve(model: nn.Module, sink_length: int) -> bool:
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads if hasattr(config, "num_attention_heads") else 0
    )
    return (
        bool(getattr(model, "_supports_sdpa", False))
        and getattr(config, "attn_logit_softcapping", None) is None  # sdpa has no soft-cap
        and head_dim >= sink_length
    )


def use_sink_share_attention(model: nn.Module, sink_length: int) -> Optional[str]:
    """Switch ``model`` to an attention whose weights output holds each query's attention on the sink tokens:
    :func:`sink_share_attention` where sdpa can serve the model, else eager attention. Returns the one it had."""
    previous = _current_attention(model)
    wanted = sink_share_attention(sink_length) if _sdpa_can_serve(model, sink_length) else EAGER
    if previous in (wanted, EAGER):
        return previous
    if not hasattr(model, "set_attn_implementation"):
        raise ConfigurationError(
            f"TaperNormConfig.distillation.sink_attention_weight needs each head's attention on the sink, and "
            f"{type(model).__name__} cannot switch its attention implementation (no set_attn_implementation); set "
            "sink_attention_weight=0"
        )
    model.set_attn_implementation(wanted)
    if wanted != EAGER and _current_attention(model) != wanted:  # attention not dispatched through the interface
        model.set_attn_implementation(EAGER)
    return previous


class SinkAttention:
    """The term for one model; owned and fed by :class:`~hf_tapernorm.training.distillation.Distillation`.

    ``attach`` switches the model to an attention that reports the sink's share (:func:`use_sink_share_attention`),
    asks its training forwards for those weights and adds the term; ``detach`` undoes all three (the model's
    attention implementation is restored).
    """

    def __init__(self, weight: float, sink_length: int) -> None:
        if sink_length < 1:
            raise ConfigurationError(
                "TaperNormConfig.distillation.sink_attention_weight > 0 needs sink_token_ids (the tokens whose share "
                "of attention it keeps); set sink_token_ids or sink_attention_weight=0"
            )
        self.weight, self.sink_length = float(weight), int(sink_length)
        self._model: Optional[nn.Module] = None
        self._previous_attention: Optional[str] = None
        self._hook = None
        self._teacher_attentions: Optional[Sequence[torch.Tensor]] = None
        self._window = torch.zeros(2, dtype=torch.float64)  # [sum of per-forward means, forwards] since log_metrics

    # ------------------------------------------------------------------ the model
    def attach(self, model: nn.Module) -> SinkAttention:
        self._model = model
        self._previous_attention = use_sink_share_attention(model, self.sink_length)
        self._hook = model.register_forward_pre_hook(self._ask_for_attentions, with_kwargs=True)
        add_training_loss_term(model, _TERM, self._term)
        if self._previous_attention != _current_attention(model):
            logger.info(
                "sink-attention term (weight %g): training forwards use %s attention instead of %s",
                self.weight,
                _current_attention(model),
                self._previous_attention,
            )
        return self

    def detach(self) -> None:
        """Remove the term and the hook and give the model back its attention implementation."""
        if self._model is None:
            return
        remove_training_loss_term(self._model, _TERM)
        self._hook.remove()
        if self._previous_attention not in (None, _current_attention(self._model)):
            self._model.set_attn_implementation(self._previous_attention)
        self._model, self._hook, self._teacher_attentions = None, None, None

    @staticmethod
    def _ask_for_attentions(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        if not module.training:
            return None
        return args, {**kwargs, "output_attentions": True}

    # ------------------------------------------------------------------ the term
    def teacher_call_arguments(self, teacher: nn.Module) -> dict[str, Any]:
        """What the distillation adds to its teacher forward: the teacher reporting its attention on the sink."""
        use_sink_share_attention(teacher, self.sink_length)
        return {"output_attentions": True}

    def keep_teacher_attentions(self, attentions: Optional[Sequence[torch.Tensor]]) -> None:
        """The teacher's attentions on the forward the distillation just scored (read once by the term)."""
        self._teacher_attentions = attentions

    def _term(self, model: nn.Module, inputs: ForwardInputs, output: Any):
        target, self._teacher_attentions = self._teacher_attentions, None
        student = getattr(output, "attentions", None)
        if not target or not student or self.weight == 0:
            return None  # the distillation term is idle (no teacher yet, or released): so is this one
        if any(layer is None for layer in student):
            raise ConfigurationError(
                f"{type(model).__name__} returned no attention weights in a training forward; the sink-attention "
                f"term needs them (its attention implementation is {_current_attention(model)!r}; set "
                "sink_attention_weight=0 to train without the term)"
            )
        kl = bernoulli_kl(sink_shares(target, self.sink_length), sink_shares(student, self.sink_length))
        kl = kl.mean(dim=(0, 2))  # over layers and heads: (batch, queries)
        mask = inputs.get("attention_mask")
        mask = mask[:, self.sink_length :].to(kl.dtype) if mask is not None else torch.ones_like(kl)
        summed = self.weight * (kl * mask).sum()
        mean = summed.detach().double().cpu() / max(float(mask.sum()), 1.0)
        self._window += torch.stack([mean, torch.ones((), dtype=torch.float64)])
        return summed, mask.sum()

    def log_metrics(self) -> dict[str, float]:
        """``taper/sink_attention``: the mean term per training forward since the previous call (then reset)."""
        total, forwards = self._window.tolist()
        self._window.zero_()
        return {"taper/sink_attention": total / forwards} if forwards else {}


__all__ = ["SinkAttention", "bernoulli_kl", "sink_share_attention", "sink_shares", "use_sink_share_attention"]
