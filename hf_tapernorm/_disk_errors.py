"""A write that failed for want of room, told apart and shown in one line: the writers (export_folded, the CLI's
full-disk line) say so naming the folder and the disk, not the writer's hidden temporary file."""

from __future__ import annotations

import errno

from safetensors import SafetensorError

from .errors import first_line

#: The system's words for a full disk, a quota or a file-size limit, in an error that carries no errno.
_DISK_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "File too large")


def says_disk_full(error: BaseException) -> bool:
    """Whether ``error`` is an OSError or safetensors' SafetensorError that names a full disk, a quota or a file-size
    limit (ENOSPC, EDQUOT, EFBIG): the writers (export_folded, the CLI's full-disk line) say so in one line."""
    if not isinstance(error, (OSError, SafetensorError)):
        return False
    return getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or any(
        words in str(error) for words in _DISK_FULL_WORDS
    )


def disk_error_text(error: BaseException) -> str:
    """``error`` in one line for a full-disk message; an OSError without the file it names, which is a writer's
    hidden temporary one (a user never sees that name, and it is gone once the write failed)."""
    if isinstance(error, OSError) and error.errno is not None and error.strerror:
        return f"{type(error).__name__}: [Errno {error.errno}] {error.strerror}"
    return first_line(error)


__all__ = ["disk_error_text", "says_disk_full"]
