"""What fold's robustness scan of a fresh export reads, and the scan itself: the data and the reference model its taper
run recorded (report.json), read again the way the run read them (its split, cache, held-out draw, out-of-corpus
text and column), and checked before the weights load, so that a recorded dataset that is gone, or an export that
would land in one, is refused first, not after the load, the fold and its check.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from .._parsing import UsageError
from ..app.data_checks import check_data_paths, check_hub_datasets, missing_local_dataset
from ..app.record import recorded_path, recorded_reference
from ..app.validation import max_positions
from ..data.corpus import prepare_from_arguments
from ..data.heldout import PYTHON_DOCS, PYTHON_DOCS_DESCRIPTION
from ..data.out_of_corpus import out_of_corpus_set
from ..data.sources import EMBEDDED_CORPUS, DataError, local_dataset_path
from ..evaluation.models import ModelSource, load_model, resolve_model
from ..evaluation.scan import robustness_scan
from .arguments import DataArguments
from .destinations import check_export_outside_data

logger = logging.getLogger("hf_tapernorm.cli")


def scan_plan(
    source: ModelSource, windows: int, output_dir: Path
) -> Optional[tuple[DataArguments, tuple[ModelSource, str]]]:
    """What the robustness scan of a fresh export reads: the data and the reference its run recorded (None: no scan,
    with a log line saying why). Read before the weights load: a recorded local dataset that is gone is refused here,
    not after the load, the fold and its check, and so is an export (``output_dir``) that would land in one."""
    if not windows:
        return None
    run = Path(source.path).resolve().parent
    facts, reference = run_report(run), recorded_reference_of(run)
    if facts is None or reference is None:
        logger.warning(
            "no robustness scan: %s is not in a taper run folder that names its data and baseline or original; scan "
            "the export with hf-tapernorm eval --scan_reference",
            source.path,
        )
        return None
    recorded, sets = facts.get("data") or {}, facts.get("evaluation_sets") or {}
    ooc_set = sets.get("out-of-corpus") or {}
    ooc = recorded.get("out_of_corpus_dataset")
    if ooc is None and ooc_set and ooc_set.get("description") != PYTHON_DOCS_DESCRIPTION:
        logger.warning(  # a run of an earlier version, which did not record which text it was
            "the robustness scan has no out-of-corpus rows: the run in %s does not record its out-of-corpus dataset",
            run,
        )
        ooc_set = {}
    default = DataArguments()  # what the run used for anything its report does not record
    data = DataArguments(
        dataset_name=_recorded_dataset(facts, run, recorded.get("dataset_path", recorded.get("source")), windows),
        dataset_config_name=recorded.get("config"),
        dataset_split=recorded.get("split", default.dataset_split),
        sample_by=recorded.get("sample_by", default.sample_by),
        data_cache_dir=_recorded_cache(recorded.get("cache_dir")),
        text_column=recorded.get("text_column"),
        block_size=int(recorded.get("block_size", default.block_size)),
        heldout_percentage=float(recorded.get("heldout_percentage", default.heldout_percentage)),
        heldout_seed=int(recorded.get("heldout_seed", default.heldout_seed)),  # absent from earlier versions' runs
        heldout_blocks=int((sets.get("held-out") or {}).get("blocks", default.heldout_blocks)),
        out_of_corpus_dataset=_recorded_dataset(facts, run, ooc, windows) or PYTHON_DOCS,
        out_of_corpus_text_column=recorded.get("out_of_corpus_text_column"),  # None in the runs of earlier versions
        out_of_corpus_blocks=int(ooc_set.get("blocks", 0)),  # no set recorded: none read
        scan_windows=windows,
    )
    check_export_outside_data(output_dir, data)  # it would become part of the run's texts
    try:  # a Hub dataset not in the cache, offline: refused now, as a local one that is gone
        check_data_paths(data)
        check_hub_datasets(data)
    except DataError as error:
        raise UsageError(f"--scan_windows {windows}: the run's text cannot be read ({error}); {_NO_SCAN}") from None
    return data, reference


#: The way out of a scan whose text cannot be read.
_NO_SCAN = "fold with --scan_windows 0 (hf-tapernorm eval --scan_reference scans the export later, on any data)"


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


def fold_scan(plan, folded, tokenizer, checkpoint: str) -> Optional[dict]:
    """The robustness scan of a fresh export (``plan``: scan_plan's, None for none)."""
    if plan is None:
        return None
    if tokenizer is None:
        logger.warning("no robustness scan: %s has no tokenizer; scan the export with hf-tapernorm eval", checkpoint)
        return None
    data, reference = plan
    sink = list(getattr(folded.config, "sink_token_ids", None) or [])
    packed = prepare_from_arguments(data, tokenizer, train_blocks=0, prefix_ids=sink)
    texts = [t for t in (packed.heldout_set, out_of_corpus_set(data, tokenizer, sink)) if t is not None]
    model = load_model(reference[0])
    return robustness_scan(
        folded,
        model,
        texts,
        block_size=data.block_size,
        windows=data.scan_windows,
        max_positions=common_positions(folded, model),
        tokenizer=tokenizer,
        reference_name=reference[1],
        seed=data.heldout_seed,
        batch_tokens=data.eval_batch_size * data.block_size,
    ).to_dict()


def common_positions(*models) -> Optional[int]:
    limits = [n for n in (max_positions(m.config) for m in models) if n]
    return min(limits) if limits else None


def run_report(folder: Path) -> Optional[dict]:
    """The report.json of the taper run folder ``folder``, or None."""
    try:
        facts = json.loads((folder / "report.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return facts if isinstance(facts, dict) else None


def recorded_reference_of(run: Path) -> Optional[tuple[ModelSource, str]]:
    """The model the scan of the run in ``run`` compares with, and its name ("baseline" or "original"), found
    from any working folder (app/record.recorded_reference); None without a report or such a model."""
    facts = run_report(run)
    found = recorded_reference(facts, run) if facts is not None else None
    return (resolve_model(str(found[0])), found[1]) if found is not None else None


__all__ = ["common_positions", "fold_scan", "recorded_reference_of", "run_report", "scan_plan"]
