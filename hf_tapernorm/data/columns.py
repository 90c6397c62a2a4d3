"""Which column of a dataset holds its text: one rule (:func:`choose_text_column`) for the loading
(corpus.text_column_of, the out-of-corpus reader) and for the check every command makes before it loads a model
(app/data_checks.py) on the columns known then, so the two cannot disagree.

Known before the loading: a Hub dataset's features (its builder's), and of a local dataset (:func:`local_columns`)
text files' one column, a parquet file's schema, a csv file's first table (read as the ``datasets`` csv builder reads
it, types and all) and a json/jsonl file's first record. A type that is not known yet (a first record's null) leaves
the rule undecided where that type would decide it: the loading, which knows every type, decides then.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO, Optional

import datasets

from .sources import DataError

#: Column name -> whether it holds strings (None: not known before the data is read).
Columns = Mapping[str, Optional[bool]]


def string_columns(features: datasets.Features) -> dict[str, bool]:
    """Column name -> whether ``datasets`` types it as strings (the only columns that can hold the text)."""
    return {name: getattr(feature, "dtype", None) in ("string", "large_string") for name, feature in features.items()}


def choose_text_column(
    columns: Columns, requested: Optional[str] = None, *, option: str = "--text_column", what: Optional[str] = None
) -> Optional[str]:
    """The column holding the text: ``requested``, else ``text``, else the only string column of ``columns``.

    DataError (naming ``option``, the option that names the column, and ``what``, the dataset, where the caller
    knows its name) for a requested column the dataset lacks, for no or several string columns without a ``text``
    one, and for no column at all (rows of ``{}``: the dataset is empty, which no column option mends). None when
    only the types not known yet could decide (the loading decides then, every type known)."""
    if not columns:  # no column to name or choose: --text_column cannot help
        raise DataError(
            f"{what or 'the dataset'} is empty: its rows hold no columns, so no text; name a dataset of text"
        )
    names = ", ".join(columns)
    if requested is not None:
        if requested not in columns:
            subject = what or "the dataset"
            raise DataError(f"{option} {requested}: {subject} has no column '{requested}'; its columns: {names}")
        return requested
    if "text" in columns:
        return "text"
    strings = [name for name, is_text in columns.items() if is_text]
    unknown = [name for name, is_text in columns.items() if is_text is None]
    if len(strings) == 1 and not unknown:
        return strings[0]
    if len(strings) > 1 or not (strings or unknown):
        prefix = f"{what}: " if what else ""
        raise DataError(f"{prefix}cannot tell which column holds the text (columns: {names}); pass {option}")
    return None


def local_columns(builder: str, files: list[Path]) -> Optional[dict[str, Optional[bool]]]:
    """The columns of a local dataset (sources.local_data_files' ``builder`` and ``files``) before it is read, from
    its first file, which the loading reads first (None: that file says nothing of them yet, or cannot be read: the
    loading then reports what it holds).

    Text files have one column, ``text``. A parquet file's schema is its columns. A csv file's first table is read as
    the ``datasets`` csv builder reads it (its pandas options, its chunk), types and all. A json/jsonl file's first
    record (its first line, or its array's first item) names the columns of the row the loading reads first: a
    column it lacks is missing from that row, which the corpus's loading refuses too; its null values say nothing of
    their type."""
    if builder == "text":
        return {"text": True}
    first = files[0]
    try:
        if builder == "parquet":
            import pyarrow.parquet as pq

            return string_columns(datasets.Features.from_arrow_schema(pq.read_schema(first)))
        if builder == "csv":
            return _csv_columns(first)
        return _first_record_columns(first)
    except (OSError, ValueError, TypeError, ImportError, OverflowError):  # what the file holds only the loading judges
        return None


def _csv_columns(path: Path) -> Optional[dict[str, Optional[bool]]]:
    """The columns of a csv file's first table, typed as the ``datasets`` csv builder types them (None: no table)."""
    import pandas as pd
    import pyarrow as pa
    from datasets.packaged_modules.csv.csv import CsvConfig

    with pd.read_csv(path, iterator=True, **CsvConfig().pd_read_csv_kwargs) as reader:
        first = next(reader, None)
    if first is None or first.empty:  # a header without rows types no column
        return None
    return dict(string_columns(datasets.Features.from_arrow_schema(pa.Table.from_pandas(first).schema)))


def _first_record_columns(path: Path) -> Optional[dict[str, Optional[bool]]]:
    """The keys of a json/jsonl file's first record, each a string column or not (None: null). The ``datasets`` json
    builder reads JSON Lines, or an array whose items are the rows (an array of strings: one ``text`` column). None
    for a file that starts otherwise (an object over several lines)."""
    with path.open("rb") as handle:
        line = handle.readline().removeprefix(b"\xef\xbb\xbf").strip()
        if line.startswith(b"["):
            record = _first_item(line, handle)
        elif line.startswith(b"{"):
            try:
                record = json.loads(line)
            except ValueError:
                return None
        else:
            return None
    if isinstance(record, str):
        return {"text": True}
    if not isinstance(record, dict):
        return None
    return {key: None if value is None else isinstance(value, str) for key, value in record.items()}


def _first_item(start: bytes, handle: BinaryIO) -> object:
    """The first item of the JSON array whose text begins with ``start`` and goes on in ``handle`` (None: none), read
    as far as that item only, in reads that double in size."""
    text, size = start, 1 << 16
    while True:
        body = text[1:].lstrip().decode("utf-8", errors="replace")
        try:
            return json.JSONDecoder().raw_decode(body)[0]
        except ValueError:
            more = handle.read(size)
            if not more:
                return None
            text, size = text + more, size * 2


__all__ = ["Columns", "choose_text_column", "local_columns", "string_columns"]
