"""A patched model's ``save_pretrained`` writes a tapered checkpoint, never a folder that looks like the base model.

transformers' ``save_pretrained`` of a patched model writes the base model's ``config.json``. Read back with
``AutoModelForCausalLM.from_pretrained``, such a folder builds the base architecture with its norms back, drops
every TaperNorm tensor as unexpected and computes another function, with only the loader's generic
unexpected-keys report to say so. So ``patch_model`` binds its own ``save_pretrained`` to the model instance (as
accelerate binds its autocast ``forward``): it runs the class's method, then names the model type
``hf_tapernorm_tapered_<type>`` in ``config.json`` (a type transformers refuses to load, with a note saying what
reads the folder) and writes the run's ``tapernorm_config.json`` beside it. Every save goes through it: a user's
``model.save_pretrained``, the Trainer's ``checkpoint-N`` folders and ``save_model``, and ``save_tapered``.

The override is an object holding the model rather than a closure, so ``copy.deepcopy`` of the model (the
distillation teacher is one) gives the copy its own, which saves the copy, and a pickled model (``torch.save`` of
the whole module) loads back with it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Union

from torch import nn

from ..config import CONFIG_NAME, TAPERED_TYPE_PREFIX, config_of

TAPERED_NOTE_KEY = "hf_tapernorm_note"
TAPERED_NOTE = (
    "a tapered checkpoint (its norms are TaperNorm layers), not a plain model: load it with "
    "hf_tapernorm.load_tapered(folder), or pass it to hf-tapernorm eval / fold"
)


class TaperedSavePretrained:
    """``save_pretrained`` of a patched model: the class's own, then ``config.json`` marked and the config beside it.

    Only the process that writes ``config.json`` (``is_main_process``, the Trainer's rank 0) marks it.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, save_directory: Union[str, os.PathLike], *args: Any, **kwargs: Any):
        result = type(self.model).save_pretrained(self.model, save_directory, *args, **kwargs)
        folder = Path(save_directory)
        if kwargs.get("is_main_process", True) and (folder / "config.json").is_file():
            mark_config_as_tapered(folder / "config.json")
            # the whole checkpoint, weights and recipe together: not TaperNormConfig.save_pretrained, which keeps a
            # folder's recipe of other weights (check_save_destination), and these weights are written already
            (folder / CONFIG_NAME).write_text(config_of(self.model).to_json_string())
        return result


def mark_config_as_tapered(path: Path) -> None:
    """Name the tapered model type in a saved ``config.json`` (once: a marked file stays as it is)."""
    values = json.loads(path.read_text())
    if not str(values.get("model_type", "")).startswith(TAPERED_TYPE_PREFIX):
        values["model_type"] = TAPERED_TYPE_PREFIX + str(values["model_type"])
    values[TAPERED_NOTE_KEY] = TAPERED_NOTE
    path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def mark_saves_as_tapered(model: nn.Module) -> None:
    """Make ``model.save_pretrained`` write a tapered checkpoint (see the module's docstring)."""
    if hasattr(type(model), "save_pretrained"):
        model.save_pretrained = TaperedSavePretrained(model)


__all__ = ["TAPERED_NOTE_KEY", "TAPERED_TYPE_PREFIX", "mark_config_as_tapered", "mark_saves_as_tapered"]
