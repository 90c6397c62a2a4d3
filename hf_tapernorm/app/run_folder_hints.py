"""A taper run's output folder passed where a model or an export goes: refused in one line that names what in it (or
beside it) the command wants, where resolve_model would call it "a folder without config.json", which says nothing of
the run's tapered/ checkpoint, its folded/ export or the model it started from.

Each command wants another thing of a run: fold its tapered/ checkpoint, eval and push its folded/ export, and bench,
taper and eval's ``--scan_reference`` an ordinary model, which a run's outputs are not: the model the run started from
(its report records it), or for the scan the model a scan of the run compares with by itself. A run that stopped
before it wrote tapered/ is pointed at the checkpoint-N folders it saved, or told that it saved none.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigurationError
from ..training.checkpoints import saved_gate
from ..utils import expand_user, json_object
from .fingerprints import holds_recorded_contents
from .record import recorded_path
from .run_folder import MANIFEST_NAME
from .scan_reference import recorded_reference
from .training_run import IDENTITY_NAME

#: What a taper run folder holds (app/taper.py's outputs and its manifest), where a saved model holds config.json.
RUN_MARKS = ("report.json", MANIFEST_NAME, "tapered", "folded")
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")

#: A hint: (the run folder as typed, without a trailing "/"; the folder) -> what to pass instead.
Hint = Callable[[str, Path], str]


def run_folder(named: Optional[str]) -> Optional[Path]:
    """The folder ``named`` when it is a taper run's output folder (no config.json, one of RUN_MARKS), else None."""
    folder = expand_user(named, strict=False) if named else None
    if folder is None or not folder.is_dir() or (folder / "config.json").exists():
        return None
    return folder if any((folder / mark).exists() for mark in RUN_MARKS) else None


def refuse_run_folder(named: Optional[str], option: str, hint: Hint) -> None:
    """Refuse (one line) a taper run's folder ``named`` given to ``option``, saying what to pass (``hint``)."""
    folder = run_folder(named)
    if folder is not None:
        where = hint(str(named).rstrip("/"), folder)
        raise ConfigurationError(f"{option} '{named}' is a taper run's folder, not a saved model: {where}")


def checkpoints(folder: Path) -> list[str]:
    """The run's Trainer checkpoint-N folders, by step."""
    found = [(int(m.group(1)), p.name) for p in folder.iterdir() if (m := _CHECKPOINT.fullmatch(p.name)) and p.is_dir()]
    return [name for _, name in sorted(found)]


def unfinished(run: str, folder: Path, use: str, then: str = "", *, folds: bool = False) -> str:
    """What a run without tapered/ holds instead: its latest checkpoint-N (``use``: what to do with it, ``then``: and
    after), or that it saved none. ``folds``: the command folds the checkpoint, so only one saved at gate 0 is named
    (refuse_unfoldable_gate refuses the others); without one, the run is to be continued to the end of its taper.
    A run whose report.json says it finished did finish: its outputs were moved or deleted since (moved_outputs)."""
    saved, gone = checkpoints(folder), moved_outputs(folder)
    if folds:
        saved = [name for name in saved if _foldable(folder / name)]
        if not saved and checkpoints(folder) and gone is None:
            return (
                "it holds no tapered/ and no checkpoint-N folder saved at gate 0 (the run stopped before its taper "
                f"ended): continue it, hf-tapernorm taper --output_dir '{run}' --resume (with its options), then {use} "
                f"its tapered/{then}"
            )
    if saved:
        held = gone or "it holds no tapered/ (the run did not finish)"
        return f"{held}: {use} one of its checkpoint-N folders, '{run}/{saved[-1]}'{then}"
    if gone is not None:
        kind = "checkpoint-N folder saved at gate 0" if folds and checkpoints(folder) else "checkpoint-N folder"
        return (
            f"{gone}, and it holds no {kind}: move them back into '{run}', or taper again into it (--output_dir "
            f"'{run}' --overwrite)"
        )
    return (
        "it holds no tapered/ and no checkpoint-N folder (the run stopped before it saved one), so nothing in it can "
        f"be used; taper again into it (--output_dir '{run}' --overwrite)"
    )


def moved_outputs(folder: Path) -> Optional[str]:
    """Where the run in ``folder`` finished (its report.json's status), which of its finished outputs are missing
    ("its tapered/ and folded/ are missing (...)"), else None: a run that finished and whose outputs were moved away
    or deleted is not one that "did not finish", and continuing it (--resume) is not what would bring them back."""
    facts = _report(folder)
    if facts is None or facts.get("status") != "finished":
        return None
    missing = [f"{name}/" for name in ("tapered", "folded") if not (folder / name).is_dir()]
    if not missing:
        return None
    are = "is" if len(missing) == 1 else "are"
    return f"its {' and '.join(missing)} {are} missing (moved or deleted: its report.json says the run finished)"


def _foldable(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` was saved at gate 0, or its files cannot tell (sharded: fold tells once it loads)."""
    gate = saved_gate(checkpoint)
    return gate is None or gate <= 0.0


def fold_hint(run: str, folder: Path) -> str:
    if not (folder / "tapered").is_dir():
        return unfinished(run, folder, "fold", folds=True)
    return f"fold its tapered checkpoint, --checkpoint '{run}/tapered'"


def finished_outputs(folder: Path) -> tuple[str, ...]:
    """Which of its finished outputs the run in ``folder`` holds, "folded" (its folded export) and "tapered" (its
    tapered checkpoint): eval's and push's hints name only what is there (a run folded elsewhere, or whose export
    was moved away, holds tapered/ alone; a run that did not finish, neither)."""
    return tuple(name for name in ("folded", "tapered") if (folder / name).is_dir())


def eval_hint(run: str, folder: Path) -> str:
    held = finished_outputs(folder)
    if "folded" in held:
        tapered = f" (or '{run}/tapered', the tapered checkpoint at g = 0)" if "tapered" in held else ""
        return f"evaluate its folded export, --model_name_or_path '{run}/folded'{tapered}"
    if "tapered" in held:
        return (
            f"it holds no folded/ export: evaluate its tapered checkpoint (at g = 0), --model_name_or_path "
            f"'{run}/tapered', or fold it first (hf-tapernorm fold --checkpoint '{run}/tapered' --output_dir "
            f"'{run}/folded') and evaluate that export"
        )
    return unfinished(run, folder, "evaluate")


def push_hint(run: str, folder: Path) -> str:
    held = finished_outputs(folder)
    if "folded" in held:
        return f"push its folded export, --export_dir '{run}/folded'"
    if "tapered" in held:
        return (
            f"it holds no folded/ export: fold its tapered checkpoint (hf-tapernorm fold --checkpoint '{run}/tapered' "
            "--output_dir EXPORT) and push that export"
        )
    return unfinished(run, folder, "fold", ", and push that export", folds=True)


def bench_hint(run: str, folder: Path) -> str:
    return f"bench builds its variants from an ordinary model, which the run's outputs are not: {_base(run, folder)}"


def taper_hint(run: str, folder: Path) -> str:
    return (
        f"to continue this run, --output_dir '{run}' --resume (with its options); to taper again from the start, "
        f"{_base(run, folder)} (its tapered/ and folded/ are no starting point: taper refuses them)"
    )


def scan_reference_hint(run: str, folder: Path) -> str:
    facts = _report(folder)
    try:
        found = recorded_reference(facts, folder) if facts is not None else None
    except (AttributeError, TypeError, ValueError, OSError):  # a report edited by hand: no reference from it
        found = None
    if found is not None:
        return (
            f"the scan compares with an ordinary model: the run's {found[1]}, --scan_reference '{found[0]}' (a scan of "
            f"'{run}/folded' compares with it without --scan_reference)"
        )
    return f"the scan compares with an ordinary model: {_base(run, folder)}"


def _base(run: str, folder: Path) -> str:
    """Pass the model the run started from: its path or Hub id, where its report (or, for a run stopped before it
    wrote one, its manifest or a checkpoint's record) records one that is there."""
    model = recorded_model(folder)
    unchecked = _unchecked_model(folder) if model is not None else None
    if unchecked is not None:
        return (
            f"pass the model the run started from, '{model}' (its records name '{unchecked}', which could not be "
            "checked: the run recorded no digests of it)"
        )
    if model is not None:
        return f"pass the model the run started from, '{model}'"
    if (folder / "report.json").exists():
        return f"pass the model the run started from (its report.json records none that is there, '{run}/report.json')"
    named = next((record["model"] for record in _identities(folder) if _named_model(record)), None)
    if named is not None:
        return (
            f"pass the model the run started from (the run wrote no report.json; its records name '{named}', "
            f"{_not_found(named, folder)})"
        )
    return "pass the model the run started from (the run wrote no report.json, and nothing in it records the model)"


def _not_found(named: str, folder: Path) -> str:
    """Why the recorded local model ``named`` is not passed: nothing is there, or what is there holds other files
    than the ones the run recorded (another model under the same relative path, or one saved over since)."""
    there = [os.path.abspath(path) for path in _local_paths(named, folder)]
    if there:
        places = " and ".join(f"'{path}'" for path in there)
        verb = "the model at {} is" if len(there) == 1 else "the models at {} are"
        return (
            f"and {verb.format(places)} not the one the run started from: its files differ from the ones the run "
            "recorded"
        )
    return "which is not there" if Path(named).is_absolute() else "which is found neither from here nor beside the run"


def recorded_model(folder: Path) -> Optional[str]:
    """The model the run in ``folder`` started from, as its report records it (a Hub id, or a local path found from
    any working folder that is still there), else as its manifest or a checkpoint records it (a run killed before its
    report: a Hub id, or a path that is still there, from the working folder or beside the run); None without one."""
    facts = _report(folder)
    return _reported_model(facts, folder) if facts is not None else _identity_model(folder)


def _reported_model(facts: dict[str, Any], folder: Path) -> Optional[str]:
    model = facts.get("model")
    source = model.get("source") if isinstance(model, dict) else None
    if not isinstance(source, str) or not source:
        return None
    if model.get("kind") == "hub":
        return source
    try:
        path = recorded_path(facts, folder, source)
        return str(path) if path is not None and path.exists() else None
    except (AttributeError, TypeError, ValueError, OSError):  # a report edited by hand
        return None


def _identity_model(folder: Path) -> Optional[str]:
    """The model a run's identity records (app/validation.run_identity): a Hub id where it fingerprinted no local
    contents (``model_contents`` None), else the first place its path names that holds the files it recorded
    (_local_paths, _holds_recorded)."""
    return _identity_found(folder)[0]


def _unchecked_model(folder: Path) -> Optional[str]:
    """The local model path (as recorded) that recorded_model names for a run without report.json although nothing
    could check it: its record holds no digests of the model (a run of an older version, or edited by hand)."""
    return _identity_found(folder)[1] if _report(folder) is None else None


def _identity_found(folder: Path) -> tuple[Optional[str], Optional[str]]:
    """(_identity_model's answer, the recorded path when that answer could not be checked against digests). Without
    digests the place beside the run comes first: a run is most often started from beside it, and from another
    working folder the same relative path may name another model."""
    for record in filter(_named_model, _identities(folder)):
        model, contents = record["model"], record.get("model_contents")
        if "model_contents" in record and contents is None:
            return model, None
        checked = isinstance(contents, dict)
        places = _local_paths(model, folder, beside_first=not checked)
        found = next((path for path in places if _holds_recorded(path, contents)), None)
        if found is not None:
            return found, None if checked else model
    return None, None


def _named_model(record: dict[str, Any]) -> bool:
    """Whether an identity ``record`` names a model (a non-empty string)."""
    return isinstance(record.get("model"), str) and bool(record["model"])


def _local_paths(model: str, folder: Path, *, beside_first: bool = False) -> list[str]:
    """Where the recorded local model path ``model`` is now, as this command can pass it: an absolute path, else a
    relative one from the working folder (as typed) and from the run's parent folder (where a run is most often
    started from: ``--output_dir RUN``), the identity recording no working folder of its own. Only those that are
    there, each folder once. ``beside_first``: the run's parent folder first, where no digests can tell the two
    apart (the run is most often started from beside it; from another working folder the path names another)."""
    path = Path(model)
    places = [model] if path.is_absolute() else [model, str(Path(os.path.abspath(folder)).parent / path)]
    places = places[::-1] if beside_first else places
    found: dict[str, str] = {}
    for place in places:
        if os.path.exists(place):
            found.setdefault(os.path.realpath(place), place)
    return list(found.values())


def _holds_recorded(path: str, contents: object) -> bool:
    """Whether ``path`` holds the files the run recorded of its model (run_identity's ``model_contents``): from
    another working folder a relative path names another model, and a model may be saved over since. A record
    without them (a run of an older version, or edited by hand) cannot tell: the path is taken."""
    if not isinstance(contents, dict):
        return True
    return holds_recorded_contents(path, contents)


def _identities(folder: Path) -> list[dict[str, Any]]:
    """The run's identity as its manifest records it, then as its checkpoints do (the latest first)."""
    records = [json_object(folder / MANIFEST_NAME).get("identity")]
    records += [json_object(folder / name / IDENTITY_NAME) for name in reversed(checkpoints(folder))]
    return [record for record in records if isinstance(record, dict)]


def _report(folder: Path) -> Optional[dict[str, Any]]:
    """The run's report.json values (None: none, or one that is damaged)."""
    return json_object(folder / "report.json") or None


__all__ = [
    "RUN_MARKS",
    "bench_hint",
    "checkpoints",
    "eval_hint",
    "finished_outputs",
    "fold_hint",
    "moved_outputs",
    "push_hint",
    "recorded_model",
    "refuse_run_folder",
    "run_folder",
    "scan_reference_hint",
    "taper_hint",
]
