"""The out-of-corpus evaluation set of a command: its data arguments' reference text, sampled into blocks.

Why a second text, and why the Python documentation by default: data/heldout.py.
"""

from __future__ import annotations

import filecmp
import logging
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .corpus import empty_cells_read_as_none, load_documents, row_text, text_column_of
from .heldout import PYTHON_DOCS, PYTHON_DOCS_DESCRIPTION, EvaluationSet, python_docs_documents, sample_blocks
from .sources import EMBEDDED_CORPUS, AnyDataset, DataError, load_text_dataset, text_digest

logger = logging.getLogger(__name__)


def out_of_corpus_set(data, tokenizer, sink_ids: Sequence[int]) -> Optional[EvaluationSet]:
    """``data.out_of_corpus_blocks`` blocks of ``data.out_of_corpus_dataset`` (None when the count is 0), a dataset's
    text read from its ``data.out_of_corpus_text_column`` (None: as --text_column's default chooses).

    The draw uses ``data.heldout_seed``, so every run of a comparison reads the same blocks. A dataset whose every
    document, or nearly all of whose paragraphs, are the corpus's is refused, and one holding some of them named in a
    WARNING (check_documents_outside_corpus).
    """
    if not data.out_of_corpus_blocks:
        return None
    name = data.out_of_corpus_dataset
    if name == PYTHON_DOCS:
        documents, description = python_docs_documents(), PYTHON_DOCS_DESCRIPTION
    else:
        what = f"--out_of_corpus_dataset '{name}'"  # the subject of its refusals, as the early checks name it
        dataset = load_text_dataset(
            name, sample_by=data.sample_by, cache_dir=data.data_cache_dir, split_option=None, name=what
        )
        option = "--out_of_corpus_text_column"
        column = text_column_of(dataset, data.out_of_corpus_text_column, option=option)
        empty = empty_cells_read_as_none(dataset)
        texts = (row_text(row, i, column, option, empty_cell=empty, what=what) for i, row in enumerate(dataset))
        check_documents_outside_corpus(data, texts, line_cut=cut_by_line(dataset, data.sample_by))
        documents = (
            (f"document {i}", row_text(row, i, column, option, empty_cell=empty, what=what))
            for i, row in enumerate(dataset)
        )
        description = f"every document of {name}"
    return sample_blocks(
        documents,
        tokenizer,
        block_size=data.block_size,
        count=data.out_of_corpus_blocks,
        seed=data.heldout_seed,
        prefix_ids=sink_ids,
        name="out-of-corpus",
        description=description,
    )


def document_key(text: str) -> int:
    """The hash by which two documents are the same text: line ends and surrounding white space aside, as the text
    loader reads a file (universal newlines: CRLF is LF) and as a JSON row or a file's last paragraph may keep them."""
    return text_digest(_unix_line_ends(text).strip())


MIN_PARAGRAPH_CHARS = 80
"""The paragraphs compared with the corpus's are this long or longer (white space runs counted as one space), and so
are the documents a WARNING counts as the corpus's: a shorter one (a closing brace, ``else:``, ``Returns:``, a
heading, a line of a licence) recurs in texts written apart, so sharing it tells nothing of where a text came from,
and many such would make a real text look like the corpus's."""

NEARLY_ALL = 0.9
"""The share of an out-of-corpus text's compared paragraphs (by their characters) that, found in the corpus, refuses
it: the corpus's text cut anew with a few paragraphs edited or added is still the corpus's."""

_BLANK_LINE = re.compile(r"\n\s*\n")


def _unix_line_ends(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def long_enough(text: str) -> bool:
    """Whether ``text`` is MIN_PARAGRAPH_CHARS long or longer, its white space runs one space each."""
    return len(" ".join(text.split())) >= MIN_PARAGRAPH_CHARS


def has_text(text: str) -> bool:
    """Whether ``text`` holds a letter or a digit: a line of punctuation or drawing alone (a rule of ``-`` or ``=``
    under a heading or between documents, a table's border, box-drawing characters) is layout, which texts written
    apart share, so it is no text to compare with the corpus's, however long."""
    return any(character.isalnum() for character in text)


def compared(text: str) -> bool:
    """Whether ``text`` (its white space runs one space each) is compared with the corpus's: long_enough, and
    has_text."""
    return len(text) >= MIN_PARAGRAPH_CHARS and has_text(text)


def cut_by_line(dataset: AnyDataset, sample_by: str) -> bool:
    """Whether ``dataset``'s documents are the lines of text files (--sample_by line): the ``text`` builder keeps a
    blank line as an empty document, so its documents, joined in file order, are the text again."""
    return sample_by == "line" and getattr(getattr(dataset, "info", None), "builder_name", None) == "text"


MAX_JOINED_CHARS = 1 << 16
"""The most characters of a line-cut text's lines (cut_by_line) joined back into one paragraph: past it, the lines
are compared each alone (those compared), and none of that paragraph is kept. A file of one document per line and
no blank line would otherwise be held whole, as one paragraph that matches nothing."""

#: A paragraph compared (its white space runs one space each) and the lines of it compared each alone.
Paragraph = tuple[str, list[str]]


def _with_paragraphs(
    texts: Iterable[str], line_cut: bool, joined: Optional[_JoinedLines] = None
) -> Iterator[tuple[str, list[Paragraph]]]:
    """Each of ``texts`` (documents in file order) with the paragraphs compared (paragraphs_with_lines) that it
    ends: its own; for a line-cut text (cut_by_line), those of the lines before it, joined back, where it is a blank
    line (and of the last lines, with an empty document after the last). Lines are mostly shorter than a paragraph,
    so compared alone they would not be: a re-wrapped copy of the corpus would pass as another text. One
    paragraph's lines are kept at a time, MAX_JOINED_CHARS of them at most (``joined``: where they are kept, to
    read afterwards what could not be compared)."""
    joined = joined or _JoinedLines()
    for text in texts:
        if not line_cut:
            yield text, paragraphs_with_lines(text)
        elif text.strip():
            yield text, joined.add(text)
        else:
            yield text, joined.end()
    if line_cut:
        yield "", joined.end()


class _JoinedLines:
    """The lines of a line-cut text's paragraph, joined back where it ends (a blank line), or each compared alone
    once they pass MAX_JOINED_CHARS (that paragraph is then compared by its lines only, and its lines too short to
    compare alone are counted in ``uncompared``, their characters)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.size = 0
        self.too_long = False
        self.uncompared = 0

    def add(self, line: str) -> list[Paragraph]:
        """Keep ``line``; the paragraphs that it makes compared alone (those of every kept line, past the cap)."""
        if self.too_long:
            return self._alone([line])
        self.lines.append(line)
        self.size += len(line)
        if self.size <= MAX_JOINED_CHARS:
            return []
        kept, self.lines, self.size, self.too_long = self.lines, [], 0, True
        return self._alone(kept)

    def _alone(self, lines: list[str]) -> list[Paragraph]:
        """Each of ``lines`` as a paragraph of its own (its white space runs one space each) where it is compared;
        the characters of the others that have text are counted in ``uncompared``."""
        found = []
        for line in lines:
            text = " ".join(line.split())
            if compared(text):
                found.append((text, []))
            elif has_text(text):
                self.uncompared += len(text)
        return found

    def end(self) -> list[Paragraph]:
        """The paragraph of the kept lines (none past the cap: its lines were compared alone), and start anew."""
        text, too_long = "\n".join(self.lines), self.too_long
        self.lines, self.size, self.too_long = [], 0, False
        return [] if too_long else paragraphs_with_lines(text)


def paragraphs_compared(text: str) -> list[str]:
    """The paragraphs of ``text`` (parts between blank lines) that are compared with the corpus's, their white space
    runs one space each (a text re-wrapped or re-indented is the same text), MIN_PARAGRAPH_CHARS long or longer and
    with text (compared)."""
    return [paragraph for paragraph, _ in paragraphs_with_lines(text)]


def paragraphs_with_lines(text: str) -> list[Paragraph]:
    """The paragraphs_compared of ``text``, each with those of its lines (when it has more than one) that are
    compared too: a text of one document per line and no blank line is one paragraph, which
    never matches the same documents re-wrapped with blank lines between them, while its lines do."""
    found = []
    for part in _BLANK_LINE.split(_unix_line_ends(text)):
        paragraph = " ".join(part.split())
        if not compared(paragraph):
            continue
        lines = (" ".join(line.split()) for line in part.split("\n"))
        found.append((paragraph, [line for line in lines if compared(line) and line != paragraph]))
    return found


@dataclass
class _TextKeys:
    """What is kept of a text to compare it with the corpus: its documents' and paragraphs' hashes (how many times
    each), which documents count in a WARNING (compared: long_enough, with text), each paragraph's length, and the
    hashes and lengths of the long lines of each paragraph (paragraphs_with_lines). Hashes only, so the memory is
    bounded whatever the texts' length."""

    documents: Counter = field(default_factory=Counter)
    long: set[int] = field(default_factory=set)
    paragraphs: Counter = field(default_factory=Counter)
    lengths: dict[int, int] = field(default_factory=dict)
    lines: dict[int, set[int]] = field(default_factory=dict)
    line_lengths: dict[int, int] = field(default_factory=dict)

    def add(self, document: str, paragraphs: list[Paragraph]) -> None:
        """Count ``document`` (unless it is white space alone) and ``paragraphs`` (those _with_paragraphs gives)."""
        if document.strip():
            key = document_key(document)
            self.documents[key] += 1
            if compared(" ".join(document.split())):
                self.long.add(key)
        for paragraph, lines in paragraphs:
            key = text_digest(paragraph)
            self.paragraphs[key] += 1
            self.lengths[key] = len(paragraph)
            for line in lines:
                line_key = text_digest(line)
                self.lines.setdefault(key, set()).add(line_key)
                self.line_lengths[line_key] = len(line)

    def holds(self, key: int) -> bool:
        """Whether ``key`` is the hash of one of the paragraphs or of their lines."""
        return key in self.paragraphs or key in self.line_lengths

    def found(self, keys: set[int]) -> set[int]:
        """The paragraphs found (``keys``: the hashes found), whole or by one of their lines or more."""
        return {key for key in self.paragraphs if key in keys or not keys.isdisjoint(self.lines.get(key, ()))}

    def characters(self, keys: Iterable[int]) -> int:
        return sum(self.paragraphs[key] * self.lengths[key] for key in keys)

    def shared_characters(self, keys: set[int]) -> int:
        """The characters of the paragraphs found (``keys``: the hashes found): a paragraph's own where it is found
        whole, else those of its lines found (its length at most)."""
        total = 0
        for key, count in self.paragraphs.items():
            if key in keys:
                total += count * self.lengths[key]
            else:
                lines = sum(self.line_lengths[line] for line in self.lines.get(key, ()) if line in keys)
                total += count * min(lines, self.lengths[key])
        return total


@dataclass
class _Found:
    """Which of a text's documents and paragraphs or their lines (their hashes) the corpus holds, and a few of the
    paragraphs."""

    documents: set[int] = field(default_factory=set)
    paragraphs: set[int] = field(default_factory=set)
    examples: list[str] = field(default_factory=list)


def _find_in_corpus(data, ours: _TextKeys) -> _Found:
    """The corpus ``data`` names read once, its documents and paragraphs (and their long lines) looked up in
    ``ours``'s paragraphs and lines; a text is hashed only where its length is one of ours (most are not), and the
    reading stops once all documents and paragraphs are found whole."""
    corpus = load_documents(data)
    column = text_column_of(corpus, data.text_column)
    lengths, found, whole = {*ours.lengths.values(), *ours.line_lengths.values()}, _Found(), 0
    batches = corpus.select_columns([column]).iter(batch_size=1024)
    texts = (text for batch in batches for text in batch[column] if isinstance(text, str))
    for text, paragraphs in _with_paragraphs(texts, cut_by_line(corpus, data.sample_by)):
        if text.strip() and (key := document_key(text)) in ours.documents:
            found.documents.add(key)
        for candidate in (each for paragraph, lines in paragraphs for each in (paragraph, *lines)):
            if len(candidate) in lengths and ours.holds(key := text_digest(candidate)) and key not in found.paragraphs:
                if len(found.examples) < 2:
                    found.examples.append(candidate)
                found.paragraphs.add(key)
                whole += key in ours.paragraphs
        if len(found.documents) == len(ours.documents) and whole == len(ours.paragraphs):
            break
    return found


def _quoted(paragraphs: Sequence[str]) -> str:
    return ", ".join(repr(p if len(p) <= 40 else p[:40] + "...") for p in paragraphs)


def check_documents_outside_corpus(data, texts: Iterable[str], *, line_cut: bool = False) -> None:
    """Refuse (one line) out-of-corpus ``texts`` (the documents of ``data.out_of_corpus_dataset``) of which every one
    is a document of the corpus ``data`` names, or whose paragraphs nearly all are paragraphs of it, and name in a
    WARNING how many are where some are: their loss is the corpus's own, printed and recorded as the loss of text the
    model was not trained on. The files' bytes (app/data_checks.py, before the model loads) tell a copy of a file
    only; the same documents in another form (JSON Lines of the texts, another line end, a trailing newline, part of
    them) are found here by their text (document_key), and the corpus's text cut at other document boundaries (one
    row of all of it, a file per chapter, one document per line) by its paragraphs and their lines
    (paragraphs_with_lines: short ones, which texts written apart share, are left out; NEARLY_ALL of the rest's
    characters refuses). ``line_cut``: ``texts`` are the lines
    of text files, blank ones included (cut_by_line), whose paragraphs are those of the lines joined back, as are the
    corpus's where it is cut so. Documents with no text are not counted, and the WARNING counts documents as long as
    a paragraph compared only: a short one shared (``else:``) tells nothing. The refusal counts every document, however
    short: texts written apart do not share every one of theirs.
    A streamed corpus is not read for this (it may be far larger than what a command reads of it, and a stream is
    not read twice): a WARNING says the text was compared by file only."""
    ours, joined = _TextKeys(), _JoinedLines()
    for text, paragraphs in _with_paragraphs(texts, line_cut, joined):
        ours.add(text, paragraphs)
    name, source = data.out_of_corpus_dataset, data.dataset_name or EMBEDDED_CORPUS
    if not ours.documents:
        return
    if data.streaming:
        logger.warning(
            "--out_of_corpus_dataset '%s': compared with the training corpus (--dataset_name '%s') by file only, not "
            "by its text: a streamed corpus (--streaming) is not read twice; make sure it is not the corpus's text in "
            "another form, or leave --streaming out to have its text compared",
            name,
            source,
        )
        return
    found = _find_in_corpus(data, ours)
    _refuse_corpus_text(name, source, ours, found)
    _warn_corpus_text(name, source, ours, found)
    _warn_uncompared(name, source, joined.uncompared)


def _refuse_corpus_text(name: str, source: str, ours: _TextKeys, found: _Found) -> None:
    """Refuse out-of-corpus text whose every document, or nearly all of whose paragraphs, are the corpus's."""
    total = sum(ours.documents.values())
    if sum(ours.documents[key] for key in found.documents) == total:
        raise DataError(
            f"--out_of_corpus_dataset '{name}': every one of its {total} documents is a document of the training "
            f"corpus (--dataset_name '{source}'), so its loss would be the corpus's own; name text the model was not "
            "trained on, or leave it out"
        )
    shared, characters = ours.shared_characters(found.paragraphs), ours.characters(ours.paragraphs)
    if characters and shared >= NEARLY_ALL * characters:
        holding = ours.found(found.paragraphs)
        raise DataError(
            f"--out_of_corpus_dataset '{name}': {sum(ours.paragraphs[k] for k in holding)} of its "
            f"{sum(ours.paragraphs.values())} paragraphs of {MIN_PARAGRAPH_CHARS} or more characters "
            f"({100 * shared // characters}% of their text) {_shared_as(holding, found)} the training corpus "
            f"(--dataset_name '{source}'), such as {_quoted(found.examples)}, so its loss would be the corpus's own; "
            "name text the model was not trained on, or leave it out"
        )


def _shared_as(holding: set[int], found: _Found) -> str:
    """How the paragraphs ``holding`` corpus text hold it: each found whole, or some by their lines only."""
    return "are paragraphs of" if holding <= found.paragraphs else "hold text of"


def _warn_corpus_text(name: str, source: str, ours: _TextKeys, found: _Found) -> None:
    """Name in a WARNING how many of the out-of-corpus documents, or else of its paragraphs, are the corpus's."""
    shared = sum(ours.documents[key] for key in found.documents & ours.long)
    if shared:
        logger.warning(
            "--out_of_corpus_dataset '%s': %d of its %d documents of %d or more characters are documents of the "
            "training corpus (--dataset_name '%s'), so the out-of-corpus loss is partly the corpus's own; name text "
            "the model was not trained on",
            name,
            shared,
            sum(ours.documents[key] for key in ours.long),
            MIN_PARAGRAPH_CHARS,
            source,
        )
    elif found.paragraphs:
        holding = ours.found(found.paragraphs)
        logger.warning(
            "--out_of_corpus_dataset '%s': %d of its %d paragraphs of %d or more characters (%d%% of their text) %s "
            "the training corpus (--dataset_name '%s'), such as %s, so the out-of-corpus loss is partly the corpus's "
            "own; name text the model was not trained on",
            name,
            sum(ours.paragraphs[key] for key in holding),
            sum(ours.paragraphs.values()),
            MIN_PARAGRAPH_CHARS,
            100 * ours.shared_characters(found.paragraphs) // ours.characters(ours.paragraphs),
            _shared_as(holding, found),
            source,
            _quoted(found.examples),
        )


def _warn_uncompared(name: str, source: str, characters: int) -> None:
    """Name in a WARNING the ``characters`` of a line-cut out-of-corpus text that were not compared with the corpus:
    lines under MIN_PARAGRAPH_CHARS of a run past MAX_JOINED_CHARS with no blank line, too long to join back into
    paragraphs and each too short to compare alone, which a re-wrapped copy of the corpus could be. Its long lines
    are compared alone, and a text of one document per line (what --sample_by line reads) gets no word for them."""
    if characters:
        logger.warning(
            "--out_of_corpus_dataset '%s': %d characters of its text were not compared with the training corpus "
            "(--dataset_name '%s'): they are lines under %d characters in a run of more than %d characters with no "
            "blank line (--sample_by line), too long to join back into paragraphs and each too short to compare "
            "alone; make sure it is not the corpus's text in another form (re-wrapped), or put blank lines between "
            "its paragraphs",
            name,
            characters,
            source,
            MIN_PARAGRAPH_CHARS,
            MAX_JOINED_CHARS,
        )


def _identity(path: Path) -> tuple[int, int]:
    """The file ``path`` is (its device and inode, links followed): the same for a hard link, a symbolic link, and
    any spelling of its path."""
    info = os.stat(path)
    return info.st_dev, info.st_ino


def corpus_files_among(files: Sequence[Path], corpus: Sequence[Path]) -> tuple[dict[Path, Path], dict[Path, Path]]:
    """Which of ``files`` (an out-of-corpus dataset's) are files of ``corpus`` (the training corpus's): the same
    file however its path is spelled or linked (hard links too), or a byte-identical copy of one, which holds the
    same text. Only files of the same size are read, and only until their first difference, so the check is cheap;
    an empty file holds no text and is no copy. Returns (the same files, the copies), each file -> the corpus's."""
    ours = {_identity(path): path for path in corpus}
    by_size: dict[int, list[Path]] = {}
    for path in ours.values():
        by_size.setdefault(path.stat().st_size, []).append(path)
    same, copies = {}, {}
    for path in files:
        if _identity(path) in ours:
            same[path] = ours[_identity(path)]
            continue
        size = path.stat().st_size
        original = next((o for o in by_size.get(size, []) if size and filecmp.cmp(path, o, shallow=False)), None)
        if original is not None:
            copies[path] = original
    return same, copies


__all__ = [
    "check_documents_outside_corpus",
    "corpus_files_among",
    "cut_by_line",
    "compared",
    "has_text",
    "long_enough",
    "MIN_PARAGRAPH_CHARS",
    "NEARLY_ALL",
    "document_key",
    "MAX_JOINED_CHARS",
    "Paragraph",
    "paragraphs_compared",
    "paragraphs_with_lines",
    "out_of_corpus_set",
]
