"""Is a checkpoint's recipe this model's? One comparison for every way a taper resumes.

A checkpoint's ``tapernorm_config.json`` is the recipe its weights (and its teacher's snapshot) were trained
with; resuming under another one silently continues a different taper. :func:`refuse_another_recipe` compares
it with the model's config and names the fields that differ; ``TaperController.load_state`` calls it, and so
does ``TaperCallback`` on a Trainer resume.

The Trainer restores the model's weights and then the optimizer's state before its first callback event of
``train()`` (``on_train_begin``), and a recipe that trains other parameters (another ``keep_norms`` or
``scope``) fails the optimizer's load first, in torch's words. Every patched model refuses TaperNorm state of
another layout before it loads (layers/load_watch.py), wherever it comes from; :func:`watch_checkpoint_loads`
plugs a finer check into that watch, which runs inside the Trainer's model load, before anything is loaded and
before the optimizer is built. It finds which of the checkpoints TaperCallback could resume from
(``resume_from_checkpoint`` of the arguments, ``<output_dir>/checkpoint-*``) is being loaded, by the TaperNorm
tensors it holds (a PEFT checkpoint by its adapters), and refuses it naming the fields of its recipe that differ (a
PEFT checkpoint always: it holds no TaperNorm state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..config import CONFIG_NAME, TaperNormConfig, config_of
from ..errors import TaperNormError, TaperStateError
from ..layers.load_watch import load_watch_of
from ..utils import WHOLE_WEIGHTS

#: A PEFT adapter's weights in a Trainer checkpoint (peft's SAFETENSORS_WEIGHTS_NAME).
ADAPTER_FILE = "adapter_model.safetensors"


#: Options a resume may change on purpose: option names, or one name as a string.
AllowedChanges = Union[str, Iterable[str]]


def allowed_changes(allow_changes: AllowedChanges) -> set[str]:
    """The option names ``allow_changes`` gives: one string is one name, not its letters (TaperCallback and
    TaperController.load_state read it the same way)."""
    return {allow_changes} if isinstance(allow_changes, str) else set(allow_changes)


def recipe_differences(folder: Path, config: TaperNormConfig, allow_changes: AllowedChanges = ()) -> Optional[str]:
    """The fields of ``folder``'s recipe that differ from ``config``, one ``field: old in the checkpoint, new now``
    each ('; '-joined), leaving out ``allow_changes``; '' when none differ; None when the folder holds no recipe."""
    if not (folder / CONFIG_NAME).is_file():
        return None
    allowed = allowed_changes(allow_changes)
    old, new = TaperNormConfig.from_pretrained(folder).options(), config.options()
    return "; ".join(
        f"{name}: {value!r} in the checkpoint, {new[name]!r} now"
        for name, value in old.items()
        if new[name] != value and name not in allowed
    )


def refuse_another_recipe(folder: Path, config: TaperNormConfig, who: str, allow_changes: AllowedChanges = ()) -> bool:
    """Refuse (one line, starting with ``who``) a checkpoint ``folder`` written under another TaperNormConfig than
    ``config``, naming the fields that differ. False when the folder holds no recipe (nothing was compared: the
    caller says so)."""
    listing = recipe_differences(folder, config, allow_changes)
    if listing:
        raise TaperStateError(
            f"{who}: the checkpoint {folder} was written with another TaperNormConfig ({listing}); "
            "patch the model with the checkpoint's config to resume it"
        )
    return listing is not None


def watch_checkpoint_loads(
    model: nn.Module,
    candidates: Callable[[], list[Path]],
    who: str,
    allow_changes: AllowedChanges = (),
    resuming: Callable[[], bool] = lambda: True,
) -> None:
    """Check every ``model.load_state_dict`` (the Trainer's checkpoint load among them) from now on, before
    anything is loaded, in the load watch ``patch_model`` registered (layers/load_watch.py), until
    :func:`stop_watching_checkpoint_loads`: a checkpoint among ``candidates()`` whose TaperNorm tensors are the
    ones being loaded and whose recipe differs from the model's is refused (:func:`refuse_another_recipe`); so is a
    PEFT checkpoint among them whose adapters are the ones being loaded (:func:`refuse_adapter_checkpoint`), while
    ``resuming()`` (a load of a checkpoint's adapters after training is a user's, to evaluate them: nothing tells it
    from a resume's but when it comes). TaperNorm state that tapered other norms than the model tapers, from
    wherever it comes, is refused by the watch itself, in ``who``'s name. Candidates with this model's recipe cost
    one small JSON read each; tensors are read only from those of another recipe, and from PEFT checkpoints when
    adapters alone are loaded."""
    check = _CandidateCheck(config_of(model), candidates, who, allowed_changes(allow_changes), resuming)
    load_watch_of(model).plug(check, who)


def stop_watching_checkpoint_loads(model: nn.Module) -> None:
    """End :func:`watch_checkpoint_loads` on ``model``; its load watch checks the TaperNorm layout alone again."""
    load_watch_of(model).unplug()


class _CandidateCheck:
    """The check :func:`watch_checkpoint_loads` plugs into a model's load watch."""

    def __init__(
        self,
        config: TaperNormConfig,
        candidates: Callable[[], list[Path]],
        who: str,
        allowed: set[str],
        resuming: Callable[[], bool],
    ) -> None:
        self.config, self.candidates, self.who, self.allowed, self.resuming = config, candidates, who, allowed, resuming

    def __call__(self, module: nn.Module, state_dict, loaded: Mapping[str, torch.Tensor]) -> None:
        for folder in self.candidates():
            if not loaded:  # adapters alone (a PEFT resume), or weights without any TaperNorm state
                if self.resuming() and is_adapter_checkpoint(folder) and holds_loaded_adapters(folder, state_dict):
                    refuse_adapter_checkpoint(folder, self.who)
                continue
            try:
                differs = bool(recipe_differences(folder, self.config, self.allowed))
            except TaperNormError:  # a damaged recipe: the resume's own check names it, if it is the one
                continue
            if differs and holds_loaded_taper_state(folder, loaded):
                refuse_another_recipe(folder, self.config, self.who, self.allowed)


def is_adapter_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` is a PEFT checkpoint: adapters (``adapter_config.json``, in it or in a folder per adapter)
    and no whole model's weights."""
    adapters = (folder / "adapter_config.json").is_file() or any(folder.glob("*/adapter_config.json"))
    return adapters and not any(any(folder.glob(pattern)) for pattern in WHOLE_WEIGHTS)


def refuse_adapter_checkpoint(folder: Path, who: str) -> None:
    """Refuse to resume from a PEFT checkpoint: it holds the adapters alone, none of the model's TaperNorm state."""
    raise TaperStateError(
        f"{who}: {folder} is a PEFT checkpoint, which holds only the adapters and none of the model's TaperNorm state "
        "(statistics, c, scale target, the norms' own weights): resuming a LoRA taper from it is not supported; run "
        "the LoRA taper again from step 0 without resume_from_checkpoint, or taper without PEFT, whose Trainer "
        "checkpoints hold the whole model"
    )


def holds_loaded_adapters(folder: Path, state_dict: Mapping[str, torch.Tensor]) -> bool:
    """Whether every tensor of one of ``folder``'s adapter files (``adapter_model.safetensors``, in it or in a folder
    per adapter) is among those of ``state_dict``, by value (PEFT loads them under other names: the adapter's own)."""
    by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for tensor in state_dict.values():
        if type(tensor) is torch.Tensor:
            by_shape.setdefault(tuple(tensor.shape), []).append(tensor)
    for file in [folder / ADAPTER_FILE, *sorted(folder.glob(f"*/{ADAPTER_FILE}"))]:
        try:
            with safe_open(str(file), framework="pt") as handle:
                names = handle.keys()  # a safetensors handle is no mapping
                stored = [handle.get_tensor(name) for name in names]
        except (SafetensorError, OSError, RuntimeError):
            continue
        if stored and all(_among(tensor, by_shape.get(tuple(tensor.shape), [])) for tensor in stored):
            return True
    return False


def _among(tensor: torch.Tensor, others: list[torch.Tensor]) -> bool:
    return any(torch.equal(tensor, other.detach().to("cpu", tensor.dtype)) for other in others)


def resume_candidates(args) -> list[Path]:
    """The checkpoints TaperCallback may resume from (``resumed_checkpoint``): the arguments'
    ``resume_from_checkpoint`` and every ``<output_dir>/checkpoint-*``."""
    found = []
    named = getattr(args, "resume_from_checkpoint", None)
    if isinstance(named, str) and Path(named).is_dir():
        found.append(Path(named))
    output = Path(args.output_dir)
    if output.is_dir():
        found += sorted(p for p in output.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir() and p not in found)
    return found


def holds_loaded_taper_state(folder: Path, loaded: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``folder``'s safetensors weights hold exactly the TaperNorm tensors being ``loaded`` (each read alone
    with ``safe_open``). False when any is missing, differs, or cannot be read (a sharded model's DTensors, a damaged
    file): then it is not the checkpoint being loaded, as far as can be told."""
    if not loaded or any(type(t) is not torch.Tensor for t in loaded.values()):
        return False
    found = 0
    try:
        for shard in sorted(folder.glob("*.safetensors")):
            if shard.name.startswith("distillation_"):
                continue
            with safe_open(str(shard), framework="pt") as handle:
                for key in set(handle.keys()) & loaded.keys():
                    tensor = loaded[key]
                    if not torch.equal(handle.get_tensor(key).to(tensor.dtype), tensor.detach().cpu()):
                        return False
                    found += 1
    except (SafetensorError, OSError, RuntimeError):
        return False
    return found == len(loaded)


__all__ = [
    "AllowedChanges",
    "allowed_changes",
    "holds_loaded_adapters",
    "holds_loaded_taper_state",
    "is_adapter_checkpoint",
    "recipe_differences",
    "refuse_adapter_checkpoint",
    "refuse_another_recipe",
    "resume_candidates",
    "stop_watching_checkpoint_loads",
    "watch_checkpoint_loads",
]
