"""Is a checkpoint's recipe this model's? One comparison for every way a taper resumes.

A checkpoint's ``tapernorm_config.json`` is the recipe its weights (and its teacher's snapshot) were trained
with; resuming under another one silently continues a different taper. :func:`refuse_another_recipe` compares
it with the model's config and names the fields that differ; ``TaperController.load_state`` calls it, and so
does ``TaperCallback`` on a Trainer resume.

The Trainer restores the model's weights and then the optimizer's state before its first callback event of
``train()`` (``on_train_begin``), and a recipe that trains other parameters (another ``keep_norms`` or
``scope``) fails the optimizer's load first, in torch's words. :func:`watch_checkpoint_loads` closes that gap
through torch's public ``load_state_dict`` post-hook, which runs inside the Trainer's model load, before the
optimizer is built: it finds which of the checkpoints TaperCallback could resume from (``resume_from_checkpoint``
of the arguments, ``<output_dir>/checkpoint-*``) has just been loaded, by the TaperNorm tensors it holds, and
refuses it when its recipe differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..config import CONFIG_NAME, TaperNormConfig, config_of
from ..errors import TaperNormError, TaperStateError
from ..layers.taper_norm import tapered_norms


def recipe_differences(folder: Path, config: TaperNormConfig, allow_changes: Iterable[str] = ()) -> Optional[str]:
    """The fields of ``folder``'s recipe that differ from ``config``, one ``field: old in the checkpoint, new now``
    each ('; '-joined), leaving out ``allow_changes``; '' when none differ; None when the folder holds no recipe."""
    if not (folder / CONFIG_NAME).is_file():
        return None
    allowed = set(allow_changes)
    old, new = TaperNormConfig.from_pretrained(folder).options(), config.options()
    return "; ".join(
        f"{name}: {value!r} in the checkpoint, {new[name]!r} now"
        for name, value in old.items()
        if new[name] != value and name not in allowed
    )


def refuse_another_recipe(folder: Path, config: TaperNormConfig, who: str, allow_changes: Iterable[str] = ()) -> bool:
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
    model: nn.Module, candidates: Callable[[], list[Path]], who: str, allow_changes: Iterable[str] = ()
) -> RemovableHandle:
    """Check every ``model.load_state_dict`` (the Trainer's checkpoint load among them) until the handle is removed:
    a checkpoint among ``candidates()`` whose TaperNorm tensors are the ones just loaded and whose recipe differs
    from the model's is refused (:func:`refuse_another_recipe`). Candidates with this model's recipe cost one small
    JSON read each; tensors are read only from those of another recipe."""
    allowed, config = set(allow_changes), config_of(model)

    def check(module: nn.Module, incompatible_keys) -> None:
        for folder in candidates():
            try:
                differs = bool(recipe_differences(folder, config, allowed))
            except TaperNormError:  # a damaged recipe: the resume's own check names it, if it is the one
                continue
            if differs and holds_loaded_taper_state(folder, module):
                refuse_another_recipe(folder, config, who, allowed)

    return model.register_load_state_dict_post_hook(check)


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


def holds_loaded_taper_state(folder: Path, model: nn.Module) -> bool:
    """Whether ``folder``'s safetensors weights hold exactly the TaperNorm tensors ``model`` holds now (each read
    alone with ``safe_open``). False when any is missing, differs, or cannot be read (a sharded model's DTensors,
    a damaged file): then it is not the checkpoint just loaded, as far as can be told."""
    wanted = {
        key: tensor
        for name, layer in tapered_norms(model, include_kept=True)
        for key, tensor in layer.state_dict(prefix=f"{name}.").items()
    }
    if not wanted or any(type(t) is not torch.Tensor for t in wanted.values()):
        return False
    found = 0
    try:
        for shard in sorted(folder.glob("*.safetensors")):
            if shard.name.startswith("distillation_"):
                continue
            with safe_open(str(shard), framework="pt") as handle:
                for key in set(handle.keys()) & wanted.keys():
                    tensor = wanted[key]
                    if not torch.equal(handle.get_tensor(key).to(tensor.dtype), tensor.detach().cpu()):
                        return False
                    found += 1
    except (SafetensorError, OSError, RuntimeError):
        return False
    return found == len(wanted)


__all__ = [
    "holds_loaded_taper_state",
    "recipe_differences",
    "refuse_another_recipe",
    "resume_candidates",
    "watch_checkpoint_loads",
]
