"""The data of a command, checked before it loads a model: one check for taper, eval, fold's scan and bench.

A command reads its text only once the model's tokenizer (eval: the model itself, and its held-out evaluation before
the out-of-corpus text) is loaded, so a mistyped path would be found minutes late; here it is found first, named by
its option. Whether a local dataset can be read is asked of sources.local_data_files, the rule the loading itself
follows (which files of a folder, which builder for a suffix), so the two cannot disagree; a Hub dataset's name is
resolved by sources.hub_dataset_builder, the builder the loading reads (check_hub_datasets, which writes into the
datasets cache and so comes after every check that writes nothing).

``--data_cache_dir`` is not read only: ``datasets`` writes its cache and lock files there, so it is checked as every
destination is (run_lock.check_destination: not a file, not in a folder a running hf-tapernorm command holds, a
place this user can write), and it is kept out of what a command wrote: a saved model's folder (a folded export, a
tapered or Trainer checkpoint, any model: its files would join the model, which a push uploads and whose contents a
``--resume`` compares) and a run folder's own files (the run folder itself, or a subfolder holding what the run
wrote: ``--overwrite`` and ``--resume`` refuse a run holding files it did not write). A cache folder of its own in a
run folder (``RUN/cache``, which a taper of that run adopts) stays allowed. It is kept out of a local dataset folder
the command reads too: the loader reads a folder's data files wherever they lie in it, so the cache's own
(dataset_info.json) would become part of that corpus for every later command. For the same reason a command's own
output (taper's run folder, eval's result, fold's export, bench's results) is kept out of the local datasets it reads
(check_output_outside: one check, in the same words for every command).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from ..data.columns import choose_text_column, local_columns, string_columns
from ..data.corpus import load_documents
from ..data.file_contents import holds_text
from ..data.heldout import PYTHON_DOCS
from ..data.out_of_corpus import corpus_files_among
from ..data.sources import (
    DEFAULT_SAMPLE_BY,
    EMBEDDED_CORPUS,
    DataError,
    check_split,
    hub_dataset_builder,
    local_data_files,
    local_dataset_path,
)
from ..errors import ConfigurationError
from ..utils import dangling_link, dangling_parent_step, expand_user, holds_model_weights
from .run_folder import RunFolder
from .run_lock import check_destination, resolved_path

logger = logging.getLogger(__name__)

#: The folder of a taper run that holds its export (taper writes it; ``fold --overwrite`` may replace it).
RUN_EXPORT = "folded"


def missing_local_dataset(name: Optional[str]) -> Optional[Path]:
    """The local path the dataset name ``name`` means when nothing is there (None: it is there, or not local)."""
    path = local_dataset_path(name)
    return path if path is not None and not path.exists() else None


def check_dataset_path(
    option: str, name: Optional[str], split: Optional[str] = None, split_option: Optional[str] = None
) -> Optional[tuple[str, list[Path]]]:
    """Refuse (DataError naming ``option``) a dataset name that is a local path the loader cannot read: nothing there,
    a file of a suffix no builder reads, a folder with no data file or mixing file types, a split (``split``, a split
    expression; None: none named) it lacks (sources.local_data_files, the rule the loading itself follows). Returns
    its builder and the files it reads (None: not a local dataset). ``split_option``: the option that names its split,
    which a refusal advises (None: none does)."""
    return local_data_files(name, f"{option} '{name}'", split, split_option)


def check_hub_dataset(
    option: str,
    name: Optional[str],
    config_name: Optional[str] = None,
    split: Optional[str] = None,
    cache_dir: Optional[str] = None,
    text_column: Optional[str] = None,
    column_option: str = "--text_column",
) -> None:
    """Refuse (DataError naming ``option``) a Hub dataset's name that does not resolve as the loading resolves it
    (sources.hub_dataset_builder: a name not on the Hub or not in the cache offline, a configuration or split it
    lacks, a slice that selects none of its rows, a file loader's name), and a text column its features do not give
    (the loading's rule, columns.choose_text_column: a ``text_column``, named by ``column_option``, it lacks; no
    ``text`` column and not one string column). Nothing for the embedded corpus and a local path. It writes into the
    datasets cache (``cache_dir``), so a command calls it after every check that may refuse it without writing
    anything."""
    if name is None or name == EMBEDDED_CORPUS or local_dataset_path(name) is not None:
        return
    try:
        builder = hub_dataset_builder(name, config_name, split, cache_dir)
    except DataError as error:
        raise DataError(f"{option}: {error}") from error
    if builder.info.features:  # a dataset whose card records no features: only the loading sees its columns
        choose_text_column(
            string_columns(builder.info.features), text_column, option=column_option, what=f"{option} '{name}'"
        )


def check_text_column(
    option: str,
    name: Optional[str],
    local: Optional[tuple[str, list[Path]]],
    text_column: Optional[str],
    column_option: str = "--text_column",
) -> None:
    """Refuse the text column of the embedded corpus or a local dataset (``local``: its builder and files, as
    check_dataset_path returns them) that the loading would refuse, by the loading's own rule
    (columns.choose_text_column) on the columns known before the data is read (columns.local_columns; the embedded
    corpus is text, whose one column is ``text``): a ``text_column`` (named by ``column_option``) it lacks; no
    ``text`` column and not one string column. A Hub dataset's are its builder's (check_hub_dataset)."""
    if local is None and name not in (None, EMBEDDED_CORPUS):
        return
    columns = {"text": True} if local is None else local_columns(*local)
    what = "the embedded corpus" if local is None else f"{option} '{name}'"
    if columns is not None:
        choose_text_column(columns, text_column, option=column_option, what=what)


def check_data_paths(data: Any, own_folder: Optional[str] = None, *, recorded: bool = False) -> None:
    """Refuse the local paths of a command's data arguments (cli/arguments.DataArguments) that cannot be used: a
    dataset or out-of-corpus dataset the loader cannot read (check_dataset_path), a split a local one lacks, a cache
    that cannot be (check_cache_folder) or that lies in a dataset folder the command reads. Nothing is written: the
    Hub names are resolved, and a local split's rows counted, by check_hub_datasets.

    ``own_folder``: the folder the command itself locks (taper's run folder); a cache inside it is that lock's to
    guard (taking it refuses a running command in, above or inside the folder; every process of a distributed run
    checks its arguments, while only the first holds the lock), so only what the folder holds is checked there.
    ``data.split_option``, where set, is the option that names --dataset_name's split (None: bench's, which has
    none); the out-of-corpus dataset has none. ``recorded``: the arguments are a run's report's (fold's scan), where an
    earlier version recorded a --sample_by its data did not read, which is still not read, so not refused.
    """
    read = datasets_read(data)
    try:
        check_split(data.dataset_name, data.dataset_split, data.streaming)
    except DataError as error:
        raise DataError(f"--dataset_split {data.dataset_split}: {error}") from None
    splits = {"--dataset_name": data.dataset_split}  # the out-of-corpus dataset is read by its default split
    split_options = {"--dataset_name": getattr(data, "split_option", "--dataset_split")}  # bench's: none
    local = {
        option: check_dataset_path(option, name, splits.get(option), split_options.get(option))
        for option, name in read.items()
    }
    _check_local_reading(data, local["--dataset_name"])
    if not recorded:
        check_sample_by(data, local)
        check_out_of_corpus_differs(data, local)
    for option, name in read.items():
        check_text_column(option, name, local[option], *_text_column(data, option))
    if data.data_cache_dir:
        check_cache_folder(data.data_cache_dir, own_folder)
        _check_cache_outside_data(data.data_cache_dir, read)


def _check_local_reading(data: Any, local: Optional[tuple[str, list[Path]]]) -> None:
    """Refuse what only a Hub dataset has, given for the embedded corpus or a local dataset (``local``: its builder
    and files, check_dataset_path's), which would ignore it: a configuration. And an out-of-corpus text column for the
    Python documentation, which has no columns."""
    name = data.dataset_name
    embedded = name in (None, EMBEDDED_CORPUS)
    what = "the embedded corpus" if embedded else f"the local dataset '{name}'"
    if (local is not None or embedded) and data.dataset_config_name:
        raise DataError(
            f"--dataset_config_name {data.dataset_config_name}: a configuration is one of a Hub dataset's; {what} "
            "has none (leave the option out)"
        )
    if data.out_of_corpus_blocks and data.out_of_corpus_dataset == PYTHON_DOCS and data.out_of_corpus_text_column:
        raise DataError(
            f"--out_of_corpus_text_column {data.out_of_corpus_text_column}: the out-of-corpus text {PYTHON_DOCS} is "
            "the Python documentation, which has no columns (leave the option out, or name an --out_of_corpus_dataset)"
        )


def check_out_of_corpus_differs(data: Any, local: Mapping[str, Optional[tuple[str, list[Path]]]]) -> None:
    """Refuse an --out_of_corpus_dataset that names the training corpus (--dataset_name), part of it, or text of it:
    its loss would be (partly) the corpus's own, printed and recorded as the measure of text the model was not
    trained on. The same corpus is the embedded one twice; one Hub dataset with no --dataset_config_name and its train
    split (what the out-of-corpus text reads; a slice of train: part of it); or local files (``local``: option -> its
    builder and files, check_dataset_path's): refused when any is a file of the corpus however its path is spelled or
    linked (hard links too), or when all are copies of its files (the same bytes: the same text); a copy among other
    files is named in a WARNING (a file two datasets share by chance, a licence, need not stop a command). The same
    documents in another form (other line ends, JSON Lines of the texts) are refused once the texts are read
    (data/out_of_corpus.check_documents_outside_corpus)."""
    other = datasets_read(data).get("--out_of_corpus_dataset")
    if other is None:
        return
    corpus = data.dataset_name or EMBEDDED_CORPUS
    theirs, ours = local.get("--out_of_corpus_dataset"), local.get("--dataset_name")
    if theirs is None and ours is None:
        named = other.casefold() == corpus.casefold() and not data.dataset_config_name
        split = (data.dataset_split or "train").replace(" ", "")
        same = named and split == "train"  # its train split, which the out-of-corpus text reads whole
        part = named and not same and any(s.split("[")[0] == "train" for s in split.split("+"))
        refusal = "names the training corpus" if same else "names part of the training corpus" if part else None
    else:
        refusal = None if theirs is None or ours is None else _corpus_text_among(other, corpus, theirs[1], ours[1])
    if refusal:
        raise DataError(
            f"--out_of_corpus_dataset '{other}' {refusal} (--dataset_name '{corpus}'); name text the model was not "
            "trained on, or leave it out"
        )


def _corpus_text_among(other: str, corpus: str, files: list[Path], corpus_files: list[Path]) -> Optional[str]:
    """What check_out_of_corpus_differs says of the out-of-corpus ``files`` that hold the corpus's text (None: none
    do, or only copies among other files, named in a WARNING here). A file with no text (empty, or white space) is
    not counted: it adds nothing to the out-of-corpus text, so a copy of the corpus beside one is a copy all the same
    (an out-of-corpus dataset of no text at all is refused as empty when it is read)."""
    files = [path for path in files if holds_text(path)]
    same, copies = corpus_files_among(files, corpus_files)
    if files and len(same) + len(copies) == len(files):
        whole = {*same.values(), *copies.values()} == set(corpus_files)
        return f"{'is a copy of' if copies else 'names'} {'' if whole else 'part of '}the training corpus"
    if same:
        return f"names text of the training corpus: its file '{next(iter(same)).name}'"
    if copies:
        logger.warning(
            "--out_of_corpus_dataset '%s': %s the same bytes as a file of the training corpus (--dataset_name "
            "'%s'), so the out-of-corpus loss is partly the corpus's own; name text the model was not trained on",
            other,
            ", ".join(f"'{path.name}'" for path in copies) + (" hold" if len(copies) > 1 else " holds"),
            corpus,
        )
    return None


def check_sample_by(data: Any, local: Mapping[str, Optional[tuple[str, list[Path]]]]) -> None:
    """Refuse a --sample_by other than the default where any dataset the command reads is not local text files
    (``local``: option -> its builder and files, check_dataset_path's; None: the embedded corpus or a Hub dataset),
    the only ones it cuts into documents: a json/csv/parquet row, a Hub dataset's row and an embedded file are one
    document whatever it says, so the option would be ignored for that dataset, yet recorded beside it in the result
    and the run's report. It applies to every dataset the command reads, so one text file among them does not make
    it right for the others."""
    sample_by = getattr(data, "sample_by", DEFAULT_SAMPLE_BY)  # a command without the option reads the default
    uncut = [option for option, found in local.items() if not (found and found[0] == "text")]
    if sample_by == DEFAULT_SAMPLE_BY or not uncut:
        return
    names = {
        "--dataset_name": data.dataset_name or EMBEDDED_CORPUS,
        "--out_of_corpus_dataset": data.out_of_corpus_dataset,
    }
    read = [
        f"{option} '{names[option]}' is one document per {'file' if names[option] == EMBEDDED_CORPUS else 'row'}"
        for option in uncut
    ]
    applies = " (the option applies to every dataset the command reads)" if len(uncut) < len(local) else ""
    raise DataError(
        f"--sample_by {sample_by}: only local text files (.txt, .md) are cut into documents by line, paragraph "
        f"or file, and {' and '.join(read)}{applies}; leave the option out"
    )


def check_hub_datasets(data: Any) -> None:
    """Resolve the Hub datasets a command's data arguments name (check_hub_dataset), and count the rows of a local
    dataset's split where a slice needs them, before its model loads and after the checks that write nothing
    (check_data_paths, the command's own folder): both write into the datasets cache."""
    for option, name in datasets_read(data).items():
        if option == "--dataset_name":
            reading = (data.dataset_config_name, data.dataset_split, data.data_cache_dir)
        else:
            reading = (None, None, data.data_cache_dir)
        check_hub_dataset(option, name, *reading, *_text_column(data, option))
    _check_local_slice(data)


def _check_local_slice(data: Any) -> None:
    """Refuse a slice of a local dataset that selects none of its rows (train[100:] of 50 rows), which only the rows
    tell: the split is read as the command's loading reads it (corpus.load_documents, which counts its rows before it
    slices them), and the datasets cache then serves that loading. A Hub dataset's rows are its builder's
    (check_hub_dataset), and a slice that selects no row whatever the rows was refused already (check_data_paths)."""
    if "[" in (data.dataset_split or "") and local_dataset_path(data.dataset_name) is not None:
        try:
            load_documents(data)
        except DataError as error:
            raise DataError(f"--dataset_name: {error}") from None


def _text_column(data: Any, option: str) -> tuple[Optional[str], str]:
    """The text column a command's data arguments name for the dataset of ``option``, and the option naming it."""
    if option == "--dataset_name":
        return data.text_column, "--text_column"
    return data.out_of_corpus_text_column, "--out_of_corpus_text_column"


def datasets_read(data: Any) -> dict[str, Optional[str]]:
    """The datasets a command's data arguments read: option -> name (the out-of-corpus one only where it is read)."""
    read = {"--dataset_name": data.dataset_name}
    if data.out_of_corpus_blocks and data.out_of_corpus_dataset != PYTHON_DOCS:
        read["--out_of_corpus_dataset"] = data.out_of_corpus_dataset
    return read


def output_target(option: str, output: str | os.PathLike) -> Path:
    """The resolved path (run_lock.resolved_path) of an output (``output``, named by ``option``: taper's, fold's and
    bench's ``--output_dir``, eval's ``--output_json``), refusing a ``..`` after a folder that does not exist
    (utils.dangling_parent_step: the kernel takes it for no folder, a lexical reading for the folder above, and the
    write that created the missing folder would fill the one above, a user's, and leave a stray folder). Every output
    check starts here, before anything is created, so each command refuses it in the same words."""
    refuse_dangling_output(option, output)
    return resolved_path(output, f"{option} '{output}'")


def refuse_dangling_output(option: str, output: str | os.PathLike, *, folder: bool = True) -> None:
    """output_target's refusal of a ``..`` after a folder that does not exist, and of a symbolic link to a folder
    that does not exist on the way (the output itself where it is a ``folder``): mkdir of such a link fails with
    EEXIST, and of a folder under it with ENOENT; one line instead, in export_folded's words. Also for a check that
    resolves the path its own way (eval's --output_json, a file: check_result_file)."""
    what = f"{option} '{output}'"
    path = expand_user(output, what)
    refusal = dangling_parent_step(path, what)
    link = dangling_link(path if folder else path.parent)
    if refusal or link:
        raise ConfigurationError(refusal or f"{what}: {link}")


def check_output_outside(
    option: str, output: str | os.PathLike, inputs: Mapping[str, Optional[str]], *, reader: str, written: str
) -> None:
    """Refuse an output (``output``, named by ``option``: a file or folder a command writes) that lies inside a local
    folder the command reads, or is a local file it reads (``inputs``: what names each -> its path; None or a Hub name
    is skipped): the loader reads a dataset folder's files wherever they lie in it, so what lands there (``written``)
    would be read as more of that dataset, or refused as a mix of file types, by this and every later command on it;
    a model folder or dataset a taper run reads would differ at its ``--resume``. ``reader``: who reads the inputs
    ("eval"). One check for taper, eval, fold's scan and bench, so that each refuses this in the same words."""
    target = output_target(option, output)
    for name, value in inputs.items():
        path = expand_user(value, f"{name} '{value}'") if value else None
        if path is None or not path.exists():
            continue  # nothing, or a Hub name
        place = path.resolve()
        if target == place or (place.is_dir() and target.is_relative_to(place)):
            raise ConfigurationError(
                f"{option} '{output}' {'is' if target == place else 'lies inside'} {name} '{value}', which {reader} "
                f"reads: {written} would become part of that input (every later command would read it changed); "
                f"choose an {option} outside it"
            )


def check_output_outside_models(
    option: str,
    output: str | os.PathLike,
    models: Mapping[str, Optional[str]],
    *,
    reader: str,
    written: str,
    export: bool = False,
    run: bool = False,
) -> None:
    """Refuse an output (``output``, named by ``option``) that is, or lies in, a model folder the command reads
    (``models``: what names each -> its path; as check_output_outside words it), any other saved model's folder (an
    export, a base model: config.json beside weights) or a taper run's folder: ``written`` would join that model (a
    push would upload it, and refuse an export until it is moved; a later load find the folder changed) or the run
    (its --overwrite and --resume refuse what it did not write). ``export``: the output is an export folder (fold's),
    which may replace the earlier export it names (check_export_folder judges that) and be a run's own ``folded/``.
    ``run``: the output is a taper run's folder (taper's), which may be an earlier run of its own (RunFolder.check
    judges whether --overwrite or --resume may use it), but lies in no other run, export or model.
    One check for every writer of taper's, bench's, eval's and fold's outputs; checked before anything loads."""
    check_output_outside(option, output, models, reader=reader, written=written)
    target = resolved_path(output, f"{option} '{output}'")
    for folder in [target, *target.parents]:
        where = f"{option} '{output}' {'is' if folder == target else 'lies in'} '{folder}'"
        if _saved_model(folder) and not (export and folder == target):
            raise ConfigurationError(
                f"{where}, a saved model's folder: {written} would join the model (a push would upload them); "
                f"choose an {option} outside it"
            )
        own_run = (export and target == folder / RUN_EXPORT) or (run and folder == target)
        if run_manifest(folder) is not None and not own_run:
            own = f" (or the run's own export, {folder / RUN_EXPORT})" if export else ""
            raise ConfigurationError(
                f"{where}, a taper run's folder: {written} would mix with the run's files, which its --overwrite and "
                f"--resume then refuse; choose an {option} outside it{own}"
            )


def _check_cache_outside_data(path: str, read: dict[str, Optional[str]]) -> None:
    """Refuse a cache in (or equal to) a local dataset folder the command reads (option -> dataset name): the files
    ``datasets`` writes there (dataset_info.json, .arrow, .lock) would be read, by this command and every later one,
    as more of the corpus, which the loading then refuses as mixed file types or columns that do not match. A hidden
    folder in it (``texts/.cache``) is not read (local_data_files skips hidden files and folders, as ``datasets``
    does), so a cache there is allowed."""
    cache = resolved_path(path, f"--data_cache_dir '{path}'")
    for option, name in read.items():
        folder = local_dataset_path(name)
        if folder is None or not folder.is_dir() or not cache.is_relative_to(folder.resolve()):
            continue
        if not any(part.startswith(".") for part in cache.relative_to(folder.resolve()).parts):
            raise DataError(
                f"--data_cache_dir '{path}' lies in the {option} folder '{name}': the cache's files would be read as "
                "more of the corpus by this and every later command on that folder; choose a --data_cache_dir "
                "outside it (or in a hidden folder of it, which is not read: '.cache')"
            )


def check_cache_folder(path: str, own_folder: Optional[str] = None) -> None:
    """Refuse (one line naming ``--data_cache_dir``) a datasets cache folder that would be written where it must not
    (see the module docstring); ``own_folder``: as for check_data_paths."""
    what = f"--data_cache_dir '{path}'"
    cache = resolved_path(path, what)
    own = resolved_path(own_folder, f"--output_dir '{own_folder}'") if own_folder else None
    if own is not None and cache == own:
        raise DataError(
            f"{what} is the --output_dir: the cache's files would mix with the run's, which --overwrite and --resume "
            "then refuse; name a folder of its own (inside the run folder if you like: --data_cache_dir "
            f"'{Path(own_folder, 'cache')}')"
        )
    if own is None or not cache.is_relative_to(own):
        advice = "wait for it to finish, or choose a --data_cache_dir outside it"
        check_destination(Path(path), what, advice=advice, option="--data_cache_dir")
    for folder in [cache, *cache.parents]:
        if _saved_model(folder):
            raise DataError(
                f"{what} lies in '{folder}', a saved model's folder: the cache's files would join the model (a push "
                "would upload them, a --resume find the model changed); choose a --data_cache_dir outside it"
            )
        manifest = run_manifest(folder)
        if manifest is not None:
            _check_in_run(what, cache, folder, manifest)


def _saved_model(folder: Path) -> bool:
    """Whether ``folder`` holds a saved model: a config.json beside weights (utils.holds_model_weights)."""
    try:
        return (folder / "config.json").is_file() and holds_model_weights(folder)
    except OSError:  # a folder this user cannot look into: no model of ours to judge
        return False


def run_manifest(folder: Path) -> Optional[dict[str, Any]]:
    """The manifest of the run folder ``folder`` (None: it is none, or this user cannot look into it)."""
    try:
        return RunFolder(folder).manifest()
    except OSError:
        return None


def _check_in_run(what: str, cache: Path, run: Path, manifest: dict[str, Any]) -> None:
    """Refuse a cache that is the run folder ``run`` (with its ``manifest``) or lies in a subfolder of it holding files
    the run wrote (its tapered/, folded/, baseline/, checkpoints, logs); a folder of its own is allowed."""
    if cache == run:
        raise DataError(
            f"{what} is the run folder '{run}': the cache's files would mix with the run's, which --overwrite and "
            f"--resume then refuse; name a folder of its own (--data_cache_dir '{run / 'cache'}')"
        )
    inside = cache.relative_to(run).as_posix() + "/"
    top = inside.split("/", 1)[0] + "/"
    written = [f for f in manifest.get("files", []) if isinstance(f, str) and f.startswith(top)]
    if any(not f.startswith(inside) for f in written):
        raise DataError(
            f"{what} lies in '{run / top}', which holds files of the run in '{run}': the cache's files would mix with "
            f"them, which --overwrite and --resume then refuse; choose a folder of its own (--data_cache_dir "
            f"'{run / 'cache'}')"
        )


__all__ = [
    "check_cache_folder",
    "check_data_paths",
    "check_dataset_path",
    "check_hub_dataset",
    "check_hub_datasets",
    "check_output_outside",
    "output_target",
    "refuse_dangling_output",
    "check_out_of_corpus_differs",
    "check_output_outside_models",
    "run_manifest",
    "check_sample_by",
    "check_text_column",
    "datasets_read",
    "missing_local_dataset",
]
