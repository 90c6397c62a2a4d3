"""What fold's robustness scan of a fresh export reads, and the scan itself: the data and the reference model its taper
run recorded (report.json), read again the way the run read them (its split, cache, held-out draw, out-of-corpus
text and column), and checked before the weights load, so that a recorded dataset that is gone, or an export that
would land in one, is refused first, not after the load, the fold and its check.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, get_args, get_type_hints

from .._parsing import UsageError
from ..app.data_checks import check_data_paths, check_hub_datasets, missing_local_dataset
from ..app.record import recorded_path
from ..app.run_membership import not_the_runs
from ..app.scan_reference import recorded_reference
from ..app.validation import max_positions
from ..data.corpus import prepare_from_arguments
from ..data.heldout import PYTHON_DOCS, PYTHON_DOCS_DESCRIPTION, EvaluationSet
from ..data.out_of_corpus import out_of_corpus_set
from ..data.sources import EMBEDDED_CORPUS, DataError, local_dataset_path
from ..errors import ConfigurationError
from ..evaluation.models import ModelSource, ModelSourceError, load_model, model_config, resolve_model
from ..evaluation.scan import robustness_scan
from ..training.checkpoints import tapered_config_of
from ..utils import SEED_LIMIT
from .arguments import MIN_BLOCK_SIZE, DataArguments
from .destinations import check_export_outside_data, check_export_outside_run_data

logger = logging.getLogger("hf_tapernorm.cli")


def scan_plan(
    source: ModelSource, windows: int, output_dir: Path, facts: Optional[dict]
) -> Optional[tuple[DataArguments, tuple[ModelSource, str]]]:
    """What the robustness scan of a fresh export reads: the data and the reference its run recorded (``facts``: the
    run's report, run_report's; None: no scan, with a log line saying why). Read before the weights load: a recorded
    local dataset that is gone is refused here, not after the load, the fold and its check, and so is an export
    (``output_dir``) that would land in one."""
    if not windows:
        return None
    run = scan_run_folder(source, "scan the export with hf-tapernorm eval --scan_reference")
    if run is None:
        return None
    reference = recorded_reference_of(run, facts, windows)
    if reference is None and not names_a_reference(facts):  # else recorded_reference said why
        logger.warning(
            "no robustness scan: %s is not in a taper run folder that names its data and a baseline or original model "
            "still there; scan the export with hf-tapernorm eval --scan_reference",
            source.path,
        )
    if facts is None or reference is None:
        return None
    report = RecordedFacts(facts, run, windows)
    recorded = report.section("data")
    ooc_set = report.section("evaluation_sets.out-of-corpus")
    ooc = report.text("data.out_of_corpus_dataset")
    if ooc is None and ooc_set and ooc_set.get("description") != PYTHON_DOCS_DESCRIPTION:
        logger.warning(  # a run of an earlier version, which did not record which text it was
            "the robustness scan has no out-of-corpus rows: the run in %s does not record its out-of-corpus dataset",
            run,
        )
        ooc_set = {}
    default = DataArguments()  # what the run used for anything its report does not record
    dataset = report.text("data.dataset_path" if "dataset_path" in recorded else "data.source")
    data = DataArguments(
        dataset_name=_recorded_dataset(facts, run, dataset, windows),
        dataset_config_name=report.text("data.config"),
        dataset_split=report.text("data.split", default.dataset_split),
        sample_by=report.choice("data.sample_by", default.sample_by, SAMPLE_BY),
        data_cache_dir=_recorded_cache(report.text("data.cache_dir")),
        text_column=report.text("data.text_column"),
        block_size=report.integer("data.block_size", default.block_size, low=MIN_BLOCK_SIZE),
        heldout_percentage=report.percentage("data.heldout_percentage", default.heldout_percentage),
        heldout_seed=report.integer("data.heldout_seed", default.heldout_seed, high=SEED_LIMIT),  # absent: earlier
        heldout_blocks=report.integer("evaluation_sets.held-out.blocks", default.heldout_blocks, low=1),
        out_of_corpus_dataset=_recorded_dataset(facts, run, ooc, windows) or PYTHON_DOCS,
        out_of_corpus_text_column=report.text("data.out_of_corpus_text_column"),  # None in earlier versions' runs
        out_of_corpus_blocks=report.integer("evaluation_sets.out-of-corpus.blocks", 0) if ooc_set else 0,
        scan_windows=windows,
    )
    report.within_positions("data.block_size", data.block_size, scan_positions(source, reference[0]))
    check_export_outside_data(output_dir, data)  # it would become part of the run's texts
    try:  # a Hub dataset not in the cache, offline: refused now, as a local one that is gone
        check_data_paths(data, recorded=True)  # a --sample_by the run recorded but did not read stays unread
        check_hub_datasets(data)
    except DataError as error:
        raise UsageError(f"--scan_windows {windows}: the run's text cannot be read ({error}); {_NO_SCAN}") from None
    return data, reference


#: The way out of a scan whose text cannot be read.
_NO_SCAN = "fold with --scan_windows 0 (hf-tapernorm eval --scan_reference scans the export later, on any data)"

#: The ways a run reads text files (DataArguments.sample_by).
SAMPLE_BY = get_args(get_type_hints(DataArguments)["sample_by"])

_MISSING = object()


class RecordedFacts:
    """The fields of a run's report.json that fold's scan reads, each read with its type and range: a report edited by
    hand ("x", null, a list, 1.5 or -1 where a seed was) is refused in one line naming report.json and the field,
    before the weights load, never read as another value nor failing later with a traceback. A field that is missing
    reads as its default: runs of earlier versions did not record it."""

    def __init__(self, facts: Mapping[str, Any], run: Path, windows: int, way_out: str = "") -> None:
        self.facts, self.run, self.windows, self.way_out = facts, run, windows, way_out or _NO_SCAN

    def _value(self, field: str) -> Any:
        """The value at the dotted ``field`` (data.heldout_seed), or _MISSING; the sections above it are objects."""
        parent, _, key = field.rpartition(".")
        return (self.section(parent) if parent else self.facts).get(key, _MISSING)

    def _refuse(self, field: str, value: Any, expected: str) -> UsageError:
        return UsageError(
            f"--scan_windows {self.windows}: the run's report.json ('{self.run / 'report.json'}') records {field} as "
            f"{json.dumps(value)}, not {expected}; {self.way_out}"
        )

    def within_positions(self, field: str, length: int, positions: Optional[int]) -> None:
        """Refuse ``length`` tokens (what ``field`` reads as, its default where it is missing) past the ``positions``
        of the models the scan reads (None: no limit known), as robustness_scan would after the load and the fold:
        its windows are ``length`` tokens and multiples of it, those within the positions."""
        if positions is None or length <= positions:
            return
        if self._value(field) is _MISSING:
            raise UsageError(
                f"--scan_windows {self.windows}: the run's report.json ('{self.run / 'report.json'}') records no "
                f"{field}, which reads as the default {length}, past the models' {positions} positions; {self.way_out}"
            )
        raise self._refuse(field, length, f"an integer within the models' {positions} positions")

    def section(self, field: str) -> dict:
        """A section (a JSON object); empty where it is missing or null."""
        value = self._value(field)
        if value is _MISSING or value is None:
            return {}
        if not isinstance(value, dict):
            raise self._refuse(field, value, "an object")
        return value

    def text(self, field: str, default: Optional[str] = None) -> Optional[str]:
        """A name or a path; null (no such setting) or missing reads as ``default``."""
        value = self._value(field)
        if value is _MISSING or value is None:
            return default
        if not isinstance(value, str):
            raise self._refuse(field, value, "a string")
        return value

    def choice(self, field: str, default: str, choices: tuple[str, ...]) -> str:
        value = self._value(field)
        if value is _MISSING:
            return default
        if value not in choices:
            raise self._refuse(field, value, f"one of {', '.join(choices)}")
        return value

    def integer(self, field: str, default: int, *, low: int = 0, high: Optional[int] = None) -> int:
        """An integer in [low, high) (a JSON number with a fraction, a bool, a string or null is refused)."""
        value = self._value(field)
        if value is _MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value >= high):
            above = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high - 1}]"
            raise self._refuse(field, value, above)
        return value

    def percentage(self, field: str, default: float) -> float:
        """A number in (0, 100)."""
        value = self._value(field)
        if value is _MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 100:
            raise self._refuse(field, value, "a number in (0, 100)")
        return float(value)


def _recorded_cache(recorded: Optional[str]) -> Optional[str]:
    """The datasets cache folder a run recorded, while it is there; else None (the default cache, as a command
    without --data_cache_dir), with a log line: fold never creates a folder its command line did not name."""
    if recorded and not Path(recorded).is_dir():
        logger.warning(
            "the run's datasets cache %s is gone: the scan reads its text through the default cache", recorded
        )
        return None
    return recorded


def _recorded_dataset(facts: dict, run: Path, recorded: Optional[str], windows: int) -> Optional[str]:
    """The dataset a run recorded (None: the embedded corpus), as fold finds it now: a local one where the run read
    it (recorded absolute; by runs of earlier versions as typed, found from the run's working and home folders:
    recorded_path), else a Hub dataset's name. A local one that is gone is refused before loading, never looked for
    from this command's working or home folder, which may hold another file of that name."""
    if recorded in (None, EMBEDDED_CORPUS, PYTHON_DOCS):
        return None
    recorded_where = "dataset_path" in (facts.get("data") or {})  # this version records a local one absolute
    if recorded_where and not Path(recorded).is_absolute():  # so this is a Hub dataset's name
        if local_dataset_path(recorded) is not None:  # the loader would read the local one in its place
            raise UsageError(
                f"--scan_windows {windows}: the run in '{run}' read the Hub dataset '{recorded}', and '{recorded}' "
                f"here is a local path, which would be read in its place; run fold from another folder, or {_NO_SCAN}"
            )
        return recorded
    local = recorded_path(facts, run, recorded)
    name = str(local) if local is not None and local.exists() else recorded  # else a Hub dataset's id
    if missing_local_dataset(name) is not None:
        raise UsageError(
            f"--scan_windows {windows}: the dataset '{local or name}' that the run in '{run}' recorded is not there; "
            f"restore it at that path, or {_NO_SCAN}"
        )
    return name


def check_export_outside_run(source: ModelSource, output_dir: Path, facts: Optional[dict]) -> None:
    """Refuse an export (``output_dir``) into a local dataset that the run of the checkpoint ``source`` recorded
    (``facts``: its report), with or without a scan (scan_plan refuses it in its own words where it scans); a dataset
    that is gone protects nothing, and is no refusal without a scan."""
    run = Path(source.path).resolve().parent
    if facts is not None:
        check_export_outside_run_data(output_dir, recorded_local_datasets(facts, run), f"the taper run in '{run}'")


def recorded_local_datasets(facts: Mapping[str, Any], run: Path) -> dict[str, str]:
    """The local datasets that the run in ``run`` recorded (its report ``facts``) and that are there now: option ->
    path. Read leniently (a field of another type is no path): nothing here is read as text."""
    data = facts.get("data") if isinstance(facts.get("data"), dict) else {}
    hub_names = "dataset_path" in data  # this version records a local dataset absolute; a relative name is a Hub id
    named = {
        "--dataset_name": data.get("dataset_path", data.get("source")),
        "--out_of_corpus_dataset": data.get("out_of_corpus_dataset"),
    }
    found = {}
    for option, recorded in named.items():
        if recorded in (EMBEDDED_CORPUS, PYTHON_DOCS) or (hub_names and not Path(str(recorded)).is_absolute()):
            continue
        try:
            path = recorded_path(dict(facts), run, recorded)
            if path is not None and path.exists():
                found[option] = str(path)
        except (OSError, ValueError):  # a path this system cannot name (a NUL byte, too long): no dataset here
            continue
    return found


def scan_texts(plan, tokenizer, source: ModelSource) -> Optional[ScanTexts]:
    """The texts the scan of ``plan`` (scan_plan's; None: no scan) reads, drawn before the weights load with the
    checkpoint's tokenizer (None: no scan, with a log line) and its sink, as the export will hold it: a recorded
    split, sampling or held-out percentage that leaves the scan no block is refused here, in fold's words (the
    report's fields, --scan_windows 0), not after the load, the fold and its check in the words of the options
    that taper and eval have and fold has not."""
    if plan is None:
        return None
    if tokenizer is None:
        logger.warning("no robustness scan: %s has no tokenizer; scan the export with hf-tapernorm eval", source.path)
        return None
    data, reference = plan
    sink = list(tapered_config_of(source.path).sink_token_ids)  # the export's (fold_model stores this sink)
    report = Path(source.path).resolve().parent / "report.json"
    try:
        heldout = prepare_from_arguments(data, tokenizer, train_blocks=0, prefix_ids=sink).heldout_set
    except DataError as error:
        raise _unscannable(data, report, "held-out", error) from None
    try:
        out_of_corpus = out_of_corpus_set(data, tokenizer, sink)
    except ConfigurationError as error:  # a DataError too
        raise _unscannable(data, report, "out-of-corpus", error) from None
    return ScanTexts(data, reference, [t for t in (heldout, out_of_corpus) if t is not None])


def _unscannable(data: DataArguments, report: Path, text: str, error: ConfigurationError) -> UsageError:
    """fold's refusal of the run's ``text`` ("held-out", "out-of-corpus") as its ``report`` records it: the fields
    that shape it, and what is wrong without the advice of taper's options (a TooLittleText's facts)."""
    fields = {"data.block_size": data.block_size}
    if text == "held-out":
        fields = {
            "data.split": data.dataset_split,
            "data.sample_by": data.sample_by,
            "data.heldout_percentage": data.heldout_percentage,
            **fields,
        }
    recorded = ", ".join(f"{field} {json.dumps(value)}" for field, value in fields.items())
    return UsageError(
        f"--scan_windows {data.scan_windows}: the run's {text} text, read as its report.json ('{report}') records it "
        f"({recorded}), cannot be scanned: {getattr(error, 'facts', error)}; {_NO_SCAN}"
    )


@dataclass
class ScanTexts:
    """What fold's scan reads, ready before the weights load: the run's data arguments (scan_plan's), the reference
    model and its name, and the evaluation texts drawn from the data."""

    data: DataArguments
    reference: tuple[ModelSource, str]
    texts: list[EvaluationSet]


def fold_scan(prepared: Optional[ScanTexts], folded, tokenizer) -> Optional[dict]:
    """The robustness scan of a fresh export (``prepared``: scan_texts's, None for none)."""
    if prepared is None:
        return None
    data = prepared.data
    model = load_model(prepared.reference[0])
    return robustness_scan(
        folded,
        model,
        prepared.texts,
        block_size=data.block_size,
        windows=data.scan_windows,
        max_positions=common_positions(folded, model),
        tokenizer=tokenizer,
        reference_name=prepared.reference[1],
        seed=data.heldout_seed,
        batch_tokens=data.eval_batch_size * data.block_size,
    ).to_dict()


def common_positions(*models) -> Optional[int]:
    return _fewest_positions(m.config for m in models)


def scan_positions(source: ModelSource, reference: ModelSource) -> Optional[int]:
    """The positions both models of fold's scan hold (common_positions of the export, whose config is the
    checkpoint's, and the reference), read from their configs before any weights load; None where neither says
    (a config that cannot be read is refused when its model loads)."""
    return _fewest_positions([model_config(source), model_config(reference)])


def _fewest_positions(configs: Iterable[Any]) -> Optional[int]:
    limits = [n for n in (max_positions(config) for config in configs if config is not None) if n]
    return min(limits) if limits else None


def run_report(folder: Path) -> Optional[dict]:
    """The report.json of the taper run folder ``folder``, or None."""
    try:
        facts = json.loads((folder / "report.json").read_text())
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON, or an integer past int()'s digits
        return None
    return facts if isinstance(facts, dict) else None


def names_a_reference(facts: Optional[dict]) -> bool:
    """Whether a run's report names a baseline or a local original for its scan: where neither is the reference
    (gone, or holding another model now), app/scan_reference.recorded_reference has said why in a WARNING."""
    if not isinstance(facts, dict):
        return False
    export, model = facts.get("export") or {}, facts.get("model") or {}
    named = isinstance(export, dict) and export.get("baseline_model")
    return bool(named or (isinstance(model, dict) and model.get("kind") != "hub" and model.get("source")))


def scan_run_folder(source: ModelSource, way_out: str) -> Optional[Path]:
    """The run folder whose recorded reference (and data) the scan of the tapered or folded ``source`` reads: the one
    it lies in; None, said in a WARNING ending in ``way_out``, where ``source`` is not that run's (not_the_runs: a
    folder copied in, a checkpoint of another run), which that run's original would score as a stranger."""
    model = Path(source.path).resolve()
    why = not_the_runs(model)
    if why is not None:
        logger.warning(
            "no robustness scan of %s: %s, so that run's baseline or original is not its reference; %s",
            source.path,
            why,
            way_out,
        )
        return None
    return model.parent


def recorded_reference_of(
    run: Path, facts: Optional[dict], windows: int, way_out: str = ""
) -> Optional[tuple[ModelSource, str]]:
    """The model the scan (of ``windows`` windows) of the run in ``run`` (``facts``: its report, run_report's) compares
    with, and its name ("baseline" or "original"), found from any working folder
    (app/scan_reference.recorded_reference); None without a report or such a model. The report's fields that find it
    are read with their types first: a hand edit ("export": "x") is refused in one line ending in ``way_out`` (fold's
    by default), neither a traceback nor a scan against another model than the run's."""
    if facts is None:
        return None
    recorded = RecordedFacts(facts, run, windows, way_out)
    for field in REFERENCE_FIELDS:
        recorded.text(field)
    found = recorded_reference(facts, run)
    if found is None:
        return None
    try:
        return resolve_model(str(found[0])), found[1]
    except ModelSourceError as error:  # a path the report names that holds no model: said as the report's, not ours
        field = "export.baseline_model" if found[1] == "baseline" else "model.source"
        raise UsageError(
            f"--scan_windows {windows}: the {found[1]} model that the run's report.json ('{run / 'report.json'}') "
            f"names in {field} cannot be read ({error}); {way_out or _NO_SCAN}"
        ) from None


#: The fields of a run's report that find the model its scan compares with (app/scan_reference.recorded_reference)
#: and the folders its relative paths are relative to (app/record.recorded_path): each a string where it is recorded.
REFERENCE_FIELDS = (
    "export.baseline_model",
    "export.tapered_checkpoint",
    "export.path",
    "model.kind",
    "model.source",
    "working_folder",
    "home_folder",
)


__all__ = [
    "ScanTexts",
    "check_export_outside_run",
    "common_positions",
    "fold_scan",
    "names_a_reference",
    "recorded_reference_of",
    "run_report",
    "scan_run_folder",
    "scan_plan",
    "scan_positions",
    "scan_texts",
]
