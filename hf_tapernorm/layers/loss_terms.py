"""Extra terms added to ``outputs.loss`` of a model's training forwards, through one pair of hooks.

The scale anchor and distillation add their terms to the model's own loss, so ``Trainer``'s default
loss computation (and any loop that calls ``outputs.loss.backward()``) picks them up without a
Trainer subclass. Each term returns a sum and the count it was summed over. Normalisation follows the
model's cross-entropy: a per-forward mean (``sum / count``), or, when the Trainer passes
``num_items_in_batch`` under gradient accumulation, ``sum / num_items_in_batch`` like the CE itself, so
accumulation gives the gradient of one large batch. Evaluation forwards are left untouched.

The hooks also record the model's own loss per forward (``pending_loss``), which the divergence
watch reads once per optimizer step, and count the training forwards that returned none
(``forwards_without_loss``: TaperCallback refuses a Trainer that computes the loss outside the model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn


@dataclass
class ForwardInputs:
    """The keyword inputs of the top-level forward being run (``attention_mask``, ``labels``, ...)."""

    values: dict = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    @property
    def label_count(self) -> Optional[torch.Tensor]:
        """Predicted tokens of this forward (labels shifted by one, -100 ignored), as the CE counts them."""
        labels = self.values.get("labels")
        return (labels[..., 1:] != -100).sum() if labels is not None else None


#: A term: ``term(model, inputs, output) -> (sum, count)`` or None (nothing to add for this forward).
Term = Callable[[nn.Module, ForwardInputs, Any], Optional[tuple[torch.Tensor, torch.Tensor]]]


class TrainingLossTerms:
    """The terms of one model, keyed by name; created and hooked on first use by :func:`loss_terms_of`."""

    def __init__(self, model: nn.Module) -> None:
        self.terms: dict[str, Term] = {}
        self.inputs = ForwardInputs()
        self.pending_loss: Optional[torch.Tensor] = None  # [sum of the model's own loss, forwards] this step
        self.forwards_without_loss = 0  # training forwards that returned no loss: every term was dropped
        self._depth = 0
        self._busy = False  # a term is running (it may call the model itself: that forward is not hooked)
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._busy:
            return
        self._depth += 1
        if self._depth == 1:
            values = dict(kwargs)
            if args:  # input_ids given positionally
                values.setdefault("input_ids", args[0])
            self.inputs = ForwardInputs(values)

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self._busy:
            return output
        self._depth -= 1
        if self._depth:
            return output  # a nested call of the same model (a teacher is a different module)
        inputs, self.inputs = self.inputs, ForwardInputs()
        loss = getattr(output, "loss", None)
        if not module.training:
            return output
        self._busy = True
        try:
            values = [(name, term(module, inputs, output)) for name, term in list(self.terms.items())]
        finally:
            self._busy = False
        if loss is None:
            self.forwards_without_loss += 1
            return output
        own = torch.stack([loss.detach().float(), torch.ones((), device=loss.device)])
        self.pending_loss = own if self.pending_loss is None else self.pending_loss.to(loss.device) + own
        items = inputs.get("num_items_in_batch")
        total = loss
        for _, value in values:
            if value is None:
                continue
            summed, count = value
            denominator = (
                items if items is not None else count.clamp_min(1.0) if torch.is_tensor(count) else max(count, 1)
            )
            if torch.is_tensor(denominator):
                denominator = denominator.to(summed.device)
            total = total + (summed / denominator).to(device=loss.device, dtype=loss.dtype)
        output.loss = total
        return output

    def take_pending_loss(self) -> Optional[torch.Tensor]:
        pending, self.pending_loss = self.pending_loss, None
        return pending

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


_ATTRIBUTE = "_tapernorm_loss_terms"


def loss_terms_of(model: nn.Module) -> TrainingLossTerms:
    """The model's loss-term registry, hooked on the model at first call (kept on the model)."""
    terms = model.__dict__.get(_ATTRIBUTE)
    if terms is None:
        terms = TrainingLossTerms(model)
        model.__dict__[_ATTRIBUTE] = terms
    return terms


def add_training_loss_term(model: nn.Module, name: str, term: Term) -> None:
    """Add ``term`` (see :data:`Term`) to ``outputs.loss`` of every training forward of ``model``."""
    loss_terms_of(model).terms[name] = term


def remove_training_loss_term(model: nn.Module, name: str) -> None:
    terms = model.__dict__.get(_ATTRIBUTE)
    if terms is not None:
        terms.terms.pop(name, None)


__all__ = [
    "ForwardInputs",
    "Term",
    "TrainingLossTerms",
    "add_training_loss_term",
    "loss_terms_of",
    "remove_training_loss_term",
]
