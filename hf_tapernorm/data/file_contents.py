"""What a local dataset's files hold, where the ``datasets`` builders would say it in their own words: tables with no
row (a CSV header alone, a JSONL file of blank lines, a JSON array of no item, a parquet schema with no row group),
and a JSON escape that is half of a UTF-16 surrogate pair (``\\ud800``), which pyarrow refuses and whose error
pandas' fallback reader hides.

A text file in another encoding than UTF-8 is told by its byte-order mark (:func:`foreign_encoding`: a UTF-16 file
that a Windows editor wrote), or without one by its NUL bytes (:func:`nul_bytes`), and the first byte that is not
UTF-8 found in the file that holds it (:func:`first_not_utf8`), where the builders say only that some file is not.

sources.load_text_dataset asks :func:`holds_text`, :func:`holds_no_rows`, :func:`foreign_encoding` and
:func:`nul_bytes` before it builds a dataset, and :func:`lone_surrogate` and :func:`first_not_utf8` after a builder
failed, so the user reads what is wrong with the file, and where.
"""

from __future__ import annotations

import codecs
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple, Optional

_CHUNK = 1 << 16

#: A JSON backslash escape: ``\\uXXXX`` or any other escaped character (``\\\\`` consumed whole, so ``\\\\ud800`` is
#: a backslash and text, not an escape).
_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|.)")


def holds_no_rows(builder: str, files: list[Path]) -> bool:
    """Whether every file of a table ``builder`` (json, csv, parquet) holds no row: 0 bytes, a JSON Lines file of
    blank lines, a JSON array of no item (``[]``, ``  [ ]``), a CSV file of its header alone, a parquet file of a
    schema and no row, and a json or csv file of white space alone (a byte-order mark first: pandas' "No columns to
    parse from file"). ``datasets`` reads such files as no split at all ("Instruction train corresponds to no data")
    or fails on them (pyarrow's "BatchSize must be greater than 0"). Text files are the caller's (:func:`holds_text`).
    A file that cannot be read so says nothing: the loading reports it."""
    reader = {"json": _no_json_rows, "csv": _header_only, "parquet": _no_parquet_rows}.get(builder)
    if reader is None or not files:
        return False
    try:
        return all(not holds_text(file) or reader(file) for file in files)
    except (OSError, ValueError, ImportError):  # what else the file holds, the loading says
        return False


def _no_json_rows(path: Path) -> bool:
    """Whether ``path`` holds only white space (a byte-order mark first) or a JSON array of no item (``[ ]``), read
    until it holds more than those two characters."""
    shown = b""
    for chunk in _chunks(path):
        shown += b"".join(chunk.split())
        if not b"[]".startswith(shown):
            return False
    return shown in (b"", b"[]")


#: Characters that show nothing: Unicode's white space (no-break and ideographic spaces too) and its
#: Default_Ignorable_Code_Point set (zero-width spaces and joiners, a byte-order mark inside the text, bidirectional
#: marks, variation selectors, Hangul fillers, tag characters, U+034F), with U+180E (once a space).
_INVISIBLE = re.compile(
    r"[\s\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f\u3164"
    r"\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]*"
)


def _visible(text: str) -> bool:
    return _INVISIBLE.fullmatch(text) is None


def holds_text(path: Path) -> bool:
    """Whether the file ``path`` holds anything but characters that show nothing (_INVISIBLE: white space, zero-width
    spaces, a byte-order mark): an empty file is no text of an out-of-corpus dataset, so neither a copy of the corpus
    nor other text beside it, and a corpus of it would be refused as too small to split (a file that cannot be read
    counts as text: its loading tells what is wrong). Read chunk by chunk as UTF-8; a byte that is not UTF-8 counts
    as text, which its loading refuses in its own words."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        if any(_visible(decoder.decode(chunk)) for chunk in _chunks(path)):
            return True
    except OSError:  # a file this user cannot read: counted, as its loading will tell
        return True
    return _visible(decoder.decode(b"", final=True))


def _chunks(path: Path) -> Iterator[bytes]:
    """The bytes of ``path`` in chunks, read as they are asked for, without a leading byte-order mark."""
    with path.open("rb") as handle:
        first = True
        while chunk := handle.read(_CHUNK):
            if first:
                chunk, first = chunk.removeprefix(b"\xef\xbb\xbf"), False
            yield chunk


def _header_only(path: Path) -> bool:
    """Whether the CSV file ``path`` has no row under its header, read as the ``datasets`` csv builder reads it."""
    import pandas as pd
    from datasets.packaged_modules.csv.csv import CsvConfig

    with pd.read_csv(path, iterator=True, **CsvConfig().pd_read_csv_kwargs) as reader:
        first = next(reader, None)
    return first is None or first.empty


def _no_parquet_rows(path: Path) -> bool:
    """Whether the parquet file ``path`` records no row (its footer's count)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows == 0


#: The byte-order marks of the other encodings of Unicode that an editor writes, with iconv's name of each; UTF-32
#: LE's first, as it begins with UTF-16 LE's.
_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


def foreign_encoding(files: list[Path]) -> Optional[tuple[Path, str]]:
    """The first of ``files`` that starts with a UTF-16 or UTF-32 byte-order mark, and that encoding (None: none
    does). Read as UTF-8, such a file fails at its first byte, and the usual advice for text that is not UTF-8
    (iconv from latin1) would turn each of its characters into two; its mark tells the encoding to convert from."""
    for path in files:
        try:
            with path.open("rb") as handle:
                start = handle.read(4)
        except OSError:  # the loading says what is wrong with it
            continue
        encoding = next((name for mark, name in _BOMS if start.startswith(mark)), None)
        if encoding is not None:
            return path, encoding
    return None


#: Where the NUL bytes lie (their offsets modulo 4) in text of another encoding written without a byte-order mark,
#: mostly ASCII (one NUL or three beside each character), with iconv's name of that encoding.
_NUL_PATTERNS = {
    frozenset({1, 3}): "utf-16le",
    frozenset({0, 2}): "utf-16be",
    frozenset({1, 2, 3}): "utf-32le",
    frozenset({0, 1, 2}): "utf-32be",
}


class NulBytes(NamedTuple):
    """Where a file holds NUL bytes (:func:`nul_bytes`): the encoding their places tell (utf-16le, utf-32be: iconv's
    names; None: binary data, no telling, or a file that is UTF-8 text before them), where they lie ("every other
    byte"), and, for a file whose start is UTF-8 text without a NUL, the offset at which they begin (None: from its
    start), which no iconv of the whole file converts; ``at_the_latest``: they begin there or before (the scan for
    their first stopped short of it, :data:`_SCANNED_CHUNKS`)."""

    path: Path
    encoding: Optional[str]
    places: str
    text_end: Optional[int] = None
    at_the_latest: bool = False


def nul_bytes(files: list[Path]) -> Optional[NulBytes]:
    """The first of ``files`` whose first chunk, or last chunk, holds NUL bytes as text of another encoding or binary
    data does (:class:`NulBytes`); None for no such file. A NUL is valid UTF-8, so such a file reads without an
    error, as text of NULs between its characters, which no tokenizer reads as the text it holds. A chunk an eighth
    or more NUL is told by their places (every other byte: UTF-16, three of four: UTF-32, each LE or BE), or else is
    binary; with fewer, by :func:`utf16_by_nul_parity` (Cyrillic or Greek UTF-16 holds a NUL beside its ASCII
    characters only). Real text holds no NUL, or a stray few, which tell neither. The last chunk is read too (one
    seek, whatever the file's size): UTF-8 text followed by UTF-16 text (``cat a.txt b16.txt``) starts clean."""
    for path in files:
        try:
            found = _nul_bytes_of(path)
        except OSError:  # the loading says what is wrong with it
            continue
        if found is not None:
            return found
    return None


def _nul_bytes_of(path: Path) -> Optional[NulBytes]:
    """Where the file ``path`` holds NUL bytes as other text or binary data does (nul_bytes), by its first chunk,
    then by its last (from an offset a multiple of 4, so that their places read as the file's)."""
    with path.open("rb") as handle:
        start = handle.read(_CHUNK)
        told = _nuls_told(start)
        if told is not None:
            text_end = _utf8_text_before_nul(start)
            return NulBytes(path, told[0] if text_end is None else None, told[1], text_end)
        size = handle.seek(0, 2)
        if size <= _CHUNK:
            return None
        # MIN_NUL_RUN (a multiple of 4) earlier: a run across the chunk's start is read whole
        offset = max(_CHUNK, (size - _CHUNK) // 4 * 4) - MIN_NUL_RUN
        handle.seek(offset)
        end = handle.read()
        told = _nuls_told(end)
        if told is None:
            return None
        handle.seek(_CHUNK - MIN_NUL_RUN)  # the first chunk's end too: a run across it begins there
        first, whole = _first_nul(handle, offset)
        if first is None:
            return NulBytes(path, None, told[1], offset + end.index(0), at_the_latest=not whole)
        return NulBytes(path, None, told[1], first)


def _nuls_told(chunk: bytes) -> Optional[tuple[Optional[str], str]]:
    """The encoding the NULs of ``chunk`` tell (None: binary data, or no telling) and where they lie; None where it
    holds none, or a stray few, as real text may."""
    many = bool(chunk) and chunk.count(0) * 8 >= len(chunk)
    encoding = _encoding_by_nul_places(chunk) if many else None
    if encoding is not None:
        return encoding, "every other byte" if encoding.startswith("utf-16") else "three bytes of every four"
    encoding = utf16_by_nul_parity(chunk)
    if encoding is not None:
        return encoding, f"at {'odd' if encoding.endswith('le') else 'even'} offsets only"
    if many:
        return None, "an eighth of its bytes or more"
    return (None, f"in a run of {MIN_NUL_RUN} or more") if _NUL_RUN in chunk else None


#: How many NULs in a row, at least, make a run that no text holds, whatever its encoding (UTF-32 holds two or
#: three): NUL padding, a truncated or preallocated file, binary data.
MIN_NUL_RUN = 16
_NUL_RUN = bytes(MIN_NUL_RUN)


#: How many bytes of UTF-8 text, at least, before a file's first NUL tell a file that is text at its start: text of
#: another encoding without a mark has its first NUL within a byte or two, or reads as control characters before it.
MIN_TEXT_BEFORE_NUL = 16

#: The control characters that no UTF-8 text holds (white space's are left out, and those a terminal log holds:
#: BEL ending a title sequence, backspace of a progress bar, ESC of colours); UTF-16 Cyrillic reads as them.
_CONTROLS = re.compile("[\x00-\x06\x0e-\x1a\x1c-\x1f\x7f]")


def _utf8_text_before_nul(start: bytes) -> Optional[int]:
    """The offset of the first NUL of ``start`` (a file's first chunk) where the bytes before it are UTF-8 text (but
    for the last, which may be the other text's first: UTF-16LE's) without control characters, of
    :data:`MIN_TEXT_BEFORE_NUL` bytes or more; None otherwise (the NULs are the whole file's encoding)."""
    first = start.find(0)
    if first < MIN_TEXT_BEFORE_NUL:
        return None
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(start[: first - 1])
    except UnicodeDecodeError:
        return None
    return None if _CONTROLS.search(text) else first


#: How many chunks, at most, are read to find where NULs begin in a file whose last chunk alone told them.
_SCANNED_CHUNKS = 256


def _first_nul(handle: BinaryIO, stop: int) -> tuple[Optional[int], bool]:
    """The offset of the first NUL that ``handle`` holds from where it stands up to ``stop`` (a file refused for the
    NULs from there on), read for :data:`_SCANNED_CHUNKS` chunks at most (None for none read), and whether every
    byte up to ``stop`` was read (no NUL before ``stop``, where none was found)."""
    for _ in range(_SCANNED_CHUNKS):
        at = handle.tell()
        chunk = handle.read(min(_CHUNK, stop - at))
        if not chunk:
            return None, True
        if 0 in chunk:
            return at + chunk.index(0), True
    return None, handle.tell() >= stop


def _encoding_by_nul_places(start: bytes) -> Optional[str]:
    """The encoding that the NULs of ``start`` (an eighth or more of it) tell by their offsets modulo 4."""
    counts = [start[place::4].count(0) for place in range(4)]
    places = frozenset(p for p in range(4) if counts[p] * 2 >= len(start[p::4]) and counts[p])
    return _NUL_PATTERNS.get(places)


#: How many NULs, at least, tell UTF-16 by their parity alone: fewer may be a stray few of a real text.
MIN_PARITY_NULS = 8


def utf16_by_nul_parity(start: bytes) -> Optional[str]:
    """ "utf-16le" or "utf-16be" where the NULs of ``start`` (a file's first bytes) lie at odd offsets (LE) or at even
    ones (BE), all but an eighth of them or fewer (U+0100, U+4E00: a NUL on the other side), and where its line ends
    are UTF-16's (``0A 00`` LE, ``00 0A`` BE, at an even offset), its NULs a thirty-second of it or more, or its
    high bytes those of one alphabet (_one_alphabet: a text of no line end); None otherwise. Text whose letters are
    not ASCII holds a NUL only beside a space, a digit or a line end, too few for the share that nul_bytes asks of
    ASCII text, and its other bytes may be valid UTF-8 (Cyrillic UTF-16LE reads as control characters); a stray NUL
    of a real UTF-8 text lies at either parity, never beside its line ends."""
    odd, even = start[1::2].count(0), start[0::2].count(0)
    most, fewest, encoding = max(odd, even), min(odd, even), "utf-16le" if odd > even else "utf-16be"
    if most < MIN_PARITY_NULS or fewest * 8 > most:
        return None
    line_end = b"\n\x00" if encoding == "utf-16le" else b"\x00\n"
    line_ends = sum(1 for m in re.finditer(re.escape(line_end), start) if m.start() % 2 == 0)
    return encoding if line_ends >= 2 or most * 32 >= len(start) or _one_alphabet(start, encoding) else None


def _one_alphabet(start: bytes, encoding: str) -> bool:
    """Whether the high bytes of ``start`` read as ``encoding`` (UTF-16) are nearly all (nine in ten) NUL or one value
    from 01 to 1F: text of one alphabet (Cyrillic, Greek, Hebrew, Arabic: U+0100 to U+1FFF) with its spaces and
    digits, in one line (no line end to tell it). A UTF-8 text's bytes at one parity are ASCII letters or bytes of
    80 and above, spread over many values."""
    high = start[1::2] if encoding == "utf-16le" else start[0::2]
    letters = Counter(byte for byte in high if 0 < byte < 0x20).most_common(1)
    return bool(letters) and (high.count(0) + letters[0][1]) * 10 >= len(high) * 9


def first_not_utf8(files: list[Path]) -> Optional[tuple[Path, int, str]]:
    """The first of ``files`` that is not UTF-8 text, the offset of its first byte that is not, and why (the
    decoder's reason: "invalid start byte"); None for none. The builders' error names no file, which in a folder
    leaves the user to find it."""
    for path in files:
        decoder, offset, pending = codecs.getincrementaldecoder("utf-8")(), 0, 0
        try:
            with path.open("rb") as handle:
                while chunk := handle.read(_CHUNK):
                    pending = len(decoder.getstate()[0])  # a character's first bytes, kept from the last chunk
                    decoder.decode(chunk)
                    offset += len(chunk)
                pending = len(decoder.getstate()[0])
                decoder.decode(b"", final=True)
        except UnicodeDecodeError as error:  # its start counts the bytes kept before the chunk
            return path, offset - pending + error.start, error.reason
        except OSError:
            continue
    return None


def lone_surrogate(files: list[Path]) -> Optional[str]:
    """Where the first ``\\uD800``-``\\uDFFF`` escape that is not half of a pair lies in the JSON ``files``: "line N of
    NAME (row N-1) holds \\uXXXX", a line of JSON Lines counted from 1; None for none."""
    for path in files:
        try:
            with path.open(encoding="utf-8", errors="replace") as handle:
                for number, line in enumerate(handle, start=1):
                    escape = _lone_escape(line) if "\\u" in line else None
                    if escape is not None:
                        return f"line {number} of {path.name} (row {number - 1}) holds \\{escape}"
        except OSError:
            continue
    return None


def _lone_escape(line: str) -> Optional[str]:
    """The first surrogate escape of ``line`` (``uD800``) that is not a high one directly followed by a low one."""
    escapes = [(match.start(), match.end(), match.group(1)) for match in _ESCAPE.finditer(line)]
    index = 0
    while index < len(escapes):
        start, end, escape = escapes[index]
        code = int(escape[1:], 16) if escape[0] == "u" and len(escape) == 5 else None
        if code is not None and 0xD800 <= code <= 0xDBFF and index + 1 < len(escapes):
            following = escapes[index + 1]
            low = following[2]
            if following[0] == end and low[0] == "u" and len(low) == 5 and 0xDC00 <= int(low[1:], 16) <= 0xDFFF:
                index += 2
                continue
        if code is not None and 0xD800 <= code <= 0xDFFF:
            return escape
        index += 1
    return None
