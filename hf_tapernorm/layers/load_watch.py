"""The load watch every patched model carries: TaperNorm state of another layout is refused before it loads.

A patched model's TaperNorms are tapered or kept by its TaperNormConfig (``keep_norms``, ``scope``). State saved
under another config tapered other norms: loaded, it would put statistics and a calibration where the model keeps
the norm (or none where it tapers one), and a Trainer resuming it fails later on the optimizer's parameter groups,
in torch's words. ``patch_model`` therefore registers a :class:`LoadWatch` through torch's public
``load_state_dict`` pre-hook, which runs before anything is loaded, in every load of the model's weights: the
Trainer's checkpoint load among them, whatever callback was or was not told of it.

``TaperCallback`` plugs its own check in first (:meth:`LoadWatch.plug`): it knows the checkpoints a Trainer may
resume from and names the recipe fields that differ, which the state alone cannot tell.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

from ..errors import TaperStateError
from .taper_norm import tapered_norms

#: A check run before the layout's: (model, the whole state dict, its TaperNorm tensors by their names in the model).
FirstCheck = Callable[[nn.Module, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], None]

_ATTRIBUTE = "_tapernorm_load_watch"


class LoadWatch:
    """The ``load_state_dict`` pre-hook of a patched model (installed by :func:`install_load_watch`)."""

    def __init__(self) -> None:
        self.first_check: Optional[FirstCheck] = None
        self.who: Optional[str] = None  # who refuses, once a plugged check names itself (TaperCallback)
        self.standing_down = False

    def plug(self, first_check: FirstCheck, who: str) -> None:
        """Run ``first_check`` before the layout check in every load from now on, and refuse in ``who``'s name."""
        self.first_check, self.who = first_check, who

    def unplug(self) -> None:
        self.first_check, self.who = None, None

    def stand_down(self) -> None:
        """Check nothing from now on: for a copy whose layers no longer follow its TaperNormConfig (a distillation
        teacher, all of whose norms are held at gate 1), into which the model's own state loads."""
        self.unplug()
        self.standing_down = True

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Check nothing inside: for a loader that checks what it loads itself, in words that name its folder
        (``load_tapered``)."""
        before, self.standing_down = self.standing_down, True
        try:
            yield
        finally:
            self.standing_down = before

    def __call__(self, module: nn.Module, state_dict, prefix: str, *_) -> None:
        if self.standing_down:
            return
        loaded = loaded_taper_state(module, state_dict, prefix)
        if self.first_check is not None:
            self.first_check(module, state_dict, loaded)
        refuse_an_unpatched_models_state(module, loaded, self.who)
        refuse_another_taper_layout(module, loaded, self.who)

    def __reduce__(self):
        """A copy (a distillation teacher is a deep copy; a pickled model) keeps the layout check, not the plugged
        one: the callback watches the model it was given, whose checkpoints it knows."""
        return (LoadWatch, ())


def install_load_watch(model: nn.Module) -> LoadWatch:
    """Register a :class:`LoadWatch` on a model being patched (``patch_model``), for the model's whole life."""
    watch = LoadWatch()
    model.register_load_state_dict_pre_hook(watch)
    setattr(model, _ATTRIBUTE, watch)
    return watch


def load_watch_of(model: nn.Module) -> LoadWatch:
    """The load watch ``patch_model`` registered on ``model``."""
    watch = getattr(model, _ATTRIBUTE, None)
    if not isinstance(watch, LoadWatch):
        raise TaperStateError(
            f"{type(model).__name__} was not patched by hf_tapernorm.patch_model (it has no load watch); patch it first"
        )
    return watch


def loaded_taper_state(model: nn.Module, state_dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """The TaperNorm tensors (statistics, c, gate, the norms' weights, a scale anchor's) that ``state_dict`` holds
    for ``model``, by their names in the model; {} when it holds none (adapters alone, an unpatched model's)."""
    return {
        key: state_dict[prefix + key]
        for name, layer in tapered_norms(model, include_kept=True)
        for key in layer.state_dict(prefix=f"{name}.")
        if prefix + key in state_dict
    }


def refuse_an_unpatched_models_state(model: nn.Module, loaded: Mapping[str, torch.Tensor], who: Optional[str]) -> None:
    """Refuse the norms' weights without any TaperNorm state (gate, c, statistics): an unpatched model's, which a
    non-strict load (the Trainer's) would put under TaperNorms that keep their own state, and whose optimizer (a
    Trainer resume) trained other parameters. Adapters alone (a PEFT load) hold no norm weight and pass, and so does
    a state with any tensor only a TaperNorm has (``taper_weight``, the statistics: a patched model's parameters
    alone, say a weight average of two tapered models)."""
    if not loaded or any(not key.endswith((".weight", ".bias")) for key in loaded):
        return
    if who is None:
        raise TaperStateError(
            f"{type(model).__name__}.load_state_dict: the state being loaded holds the norms' weights but none of "
            "their TaperNorm state (gate, c, statistics), as an unpatched model's does; load an unpatched model's "
            "weights before patch_model, a tapered checkpoint with hf_tapernorm.load_tapered, or the norms' weights "
            "with their TaperNorm state"
        )
    raise TaperStateError(
        f"{who}: the checkpoint being loaded holds the norms' weights but no TaperNorm state (gate, c, statistics), "
        "so a model that patch_model had not patched wrote it; resume a checkpoint of a tapered run, or start this "
        "run without resume_from_checkpoint (patch_model the checkpoint's model to taper it from there)"
    )


def refuse_another_taper_layout(model: nn.Module, loaded: Mapping[str, torch.Tensor], who: Optional[str]) -> None:
    """Refuse TaperNorm state that tapered other norms than ``model`` tapers (another ``keep_norms``, ``scope`` or
    recipe), told by its statistics: only a tapered norm gathers them or is calibrated. Where it comes from is not
    known here, so the fields of its recipe cannot be named; ``who`` (TaperCallback) says how to have them named."""
    kept_now, tapered_now = taper_layout_differences(model, loaded)
    if not kept_now and not tapered_now:
        return
    listing = "; ".join(
        f"{what}: {_names(names)}"
        for what, names in (("tapered in it, kept now", kept_now), ("kept in it, tapered now", tapered_now))
        if names
    )
    if who is None:
        raise TaperStateError(
            f"{type(model).__name__}.load_state_dict: the state being loaded tapered other norms than the model's "
            f"TaperNormConfig tapers ({listing}), so it was written with another TaperNormConfig; patch the model "
            "with that config (the tapernorm_config.json saved with it) to load it"
        )
    raise TaperStateError(
        f"{who}: the checkpoint being loaded tapered other norms than the model's TaperNormConfig tapers ({listing}), "
        "so it was written with another TaperNormConfig; patch the model with the checkpoint's config to resume it (a "
        "checkpoint outside output_dir must also be named in TrainingArguments(resume_from_checkpoint=...), where "
        f"{who} reads its recipe and names the fields that differ)"
    )


def taper_layout_differences(model: nn.Module, loaded: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """The norms ``loaded`` tapered that ``model`` keeps, and those it kept that ``model`` tapers. A norm tapered in
    it has statistics (``ema_steps`` above 0) or is calibrated; ([], []) when no norm of it has either (no step was
    trained: nothing tells), or a value cannot be read here (a sharded model's DTensors)."""
    tapered_there = {}
    for name, layer in tapered_norms(model, include_kept=True):
        steps, calibrated = loaded.get(f"{name}.ema_steps"), loaded.get(f"{name}.calibrated")
        if type(steps) is not torch.Tensor or type(calibrated) is not torch.Tensor or steps.is_meta:
            continue
        tapered_there[layer.site_name or name] = (bool(steps.item() > 0 or calibrated.item()), layer.tapered)
    if not any(there for there, _ in tapered_there.values()):
        return [], []
    kept_now = [name for name, (there, now) in tapered_there.items() if there and not now]
    tapered_now = [name for name, (there, now) in tapered_there.items() if now and not there]
    return kept_now, tapered_now


def _names(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")


__all__ = [
    "LoadWatch",
    "install_load_watch",
    "load_watch_of",
    "loaded_taper_state",
    "refuse_an_unpatched_models_state",
    "refuse_another_taper_layout",
    "taper_layout_differences",
]
