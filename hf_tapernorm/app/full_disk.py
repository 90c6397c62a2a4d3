"""A disk that fills up while a folder is written, as one line: full_disk_refused.

The check before a run or a fold (preflight.check_free_space) counts what it will write; the disk can still fill up
meanwhile (another process, a quota, a file-size limit), and the writers then fail in their own words: an OSError
(ENOSPC, EDQUOT, EFBIG; or the package's own refusal raised from one), safetensors' SafetensorError that wraps one,
or torch.save's archive writer, whose C++ stream only says that it failed (a RuntimeError: "unexpected pos ...",
"PytorchStreamWriter failed ...", "basic_ios::clear: iostream error"). The words of that last one are the same
whatever the stream's trouble was, so it is taken for a full disk only where the disk is full or a file-size limit
is set; otherwise it passes unchanged, like any other error.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

from safetensors import SafetensorError

from .._disk_errors import disk_error_text, says_disk_full
from ..errors import ConfigurationError

try:
    import resource
except ImportError:  # Windows: no file-size limit to read
    resource = None  # type: ignore[assignment]

#: What a fold says after its disk filled up: write_folder removed the partial export.
NOTHING_KEPT = "nothing was kept: free space (or lift the file-size limit), or choose an --output_dir on another disk"

#: torch.save's archive writer (caffe2's PytorchStreamWriter over a C++ ostream) when a write fails.
_TORCH_WRITER_WORDS = ("unexpected pos", "file write failed", "PytorchStreamWriter failed", "iostream error")

#: Free bytes under which a disk counts as full once a write failed: a failed write fills it up to the last blocks.
FULL_MARGIN = 16 * 2**20


@contextlib.contextmanager
def full_disk_refused(
    output_dir: Path,
    writing: str = "the export",
    then: Callable[[], str] = lambda: NOTHING_KEPT,
    *,
    named: str = "--output_dir",
) -> Iterator[None]:
    """A disk that fills up while ``output_dir`` is written (see the module docstring) as one line
    (ConfigurationError) naming the folder (``named``: what it is to the user, the option that gave it), ``writing``
    (what was being written) and ``then()`` (what is left and what to do, asked once the disk has filled); any other
    error passes unchanged."""
    try:
        yield
    except (OSError, SafetensorError, RuntimeError, ConfigurationError) as error:
        full = _full_disk_error(error, output_dir)
        if full is None:
            raise
        raise ConfigurationError(
            f"{named} {output_dir}: its disk could not take {writing} ({disk_error_text(full)}); {then()}"
        ) from None


def _full_disk_error(error: BaseException, output_dir: Path) -> Optional[BaseException]:
    """The error in ``error``'s chain of causes that says the disk is full: itself, or the OSError a writer's own
    refusal was raised from (export/writing.py names its hidden temporary folder and says nothing of the disk), or
    torch's writer failing where the disk is full or limited; None otherwise."""
    full = next((link for link in _chain(error, contexts=False) if says_disk_full(link)), None)
    if full is None and _torch_writer_failed(error) and _disk_full_or_limited(output_dir):
        return error
    return full


def _chain(error: BaseException, *, contexts: bool) -> Iterator[BaseException]:
    """``error`` and the errors it was raised from (``contexts``: and those raised while it was handled), each once."""
    seen: set[int] = set()
    link: Optional[BaseException] = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or (link.__context__ if contexts else None)


def _torch_writer_failed(error: BaseException) -> bool:
    """A RuntimeError of torch.save's writer: its text, or that of an error in its chain (the writer's "unexpected
    pos" is raised while the stream's "iostream error" is handled), is the writer's."""
    if not isinstance(error, RuntimeError):
        return False
    return any(any(words in str(link) for words in _TORCH_WRITER_WORDS) for link in _chain(error, contexts=True))


def _disk_full_or_limited(output_dir: Path) -> bool:
    """Whether a write into ``output_dir`` can have failed for want of room: its disk has under FULL_MARGIN free,
    or a file-size limit (``ulimit -f``) is set."""
    if resource is not None and resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return True
    folder = Path(output_dir).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free < FULL_MARGIN
    except OSError:
        return False


__all__ = ["FULL_MARGIN", "NOTHING_KEPT", "full_disk_refused"]
