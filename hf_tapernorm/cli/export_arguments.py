"""The options of the commands that work on an export: ``fold`` (a tapered checkpoint into a norm-free export) and
``push`` (an export to the Hub). Dataclasses for transformers' ``HfArgumentParser``, checked in ``__post_init__``
as arguments.py's are, so a bad value fails before anything is read or written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from ..errors import ConfigurationError
from ..utils import expand_user, expand_user_options
from .arguments import TRUST_SHARDED_HELP, check_positive, option_help


@dataclass
class FoldArguments:
    checkpoint: str = field(
        metadata=option_help("A tapered checkpoint (a run's tapered/ folder or a checkpoint-N in it).")
    )
    output_dir: str = field(metadata=option_help("Where to write the folded export."))
    tied_head: Literal["untie", "scale"] = field(
        default="untie", metadata=option_help("Tapered final norm with tied embeddings: untie | scale.")
    )
    tolerance: Optional[float] = field(
        default=None, metadata=option_help("Relative logit tolerance of the fold check.")
    )
    overwrite: bool = field(default=False, metadata=option_help("Replace --output_dir if it is an earlier export."))
    trust_sharded_checkpoint: bool = field(default=False, metadata=option_help(TRUST_SHARDED_HELP))
    scan_windows: int = field(
        default=16,
        metadata=option_help(
            "Robustness scan of the export (as taper's --scan_windows) on the run's own evaluation texts, against "
            "its baseline or original: for a checkpoint inside a taper run folder (0: no scan)."
        ),
    )

    def __post_init__(self) -> None:
        check_positive("tolerance", self.tolerance)
        check_positive("scan_windows", self.scan_windows, allow_zero=True)
        expand_user_options(self, "checkpoint", "output_dir")
        self.output_dir = str(expand_user(self.output_dir))  # a quoted '~/x' (or one in an options file) too


@dataclass
class PushArguments:
    export_dir: str = field(metadata=option_help("A folded export written by taper or fold."))
    repo_id: str = field(
        metadata=option_help(
            "Hub repository, e.g. me/smollm2-135m-normfree; a name without an owner goes under the token's user."
        )
    )
    private: bool = field(
        default=True,
        metadata=option_help(
            "Create the repository as private (the default: publishing is a decision; --private false or "
            "--no_private creates a public one). An existing repository keeps its visibility.",
            negated_help="Create the repository as public (as --private false). An existing repository keeps its "
            "visibility.",
        ),
    )
    include: list[str] = field(
        default_factory=list,
        metadata=option_help(
            "Only the files the export wrote are uploaded; any other file in --export_dir is refused unless one of "
            "these fnmatch patterns names its path inside it, e.g. --include 'samples/*.txt' ('notes.txt': the "
            "top-level file only; '*' also matches '/'; './' is dropped). Repeated --include patterns add up. The "
            "package's bookkeeping files (.hf_tapernorm_* names, and files under such a folder) are never uploaded, "
            "whatever a pattern names; a WARNING names a pattern that matches only those."
        ),
    )
    token: Optional[str] = field(default=None, metadata=option_help("Hub token (default: the logged-in one)."))
    commit_message: str = field(
        default="Upload norm-free model (hf_tapernorm)",
        metadata=option_help("Commit message: a title line, and a body after a line break if you like (as git's)."),
    )
    MULTILINE: ClassVar[tuple[str, ...]] = ("commit_message",)  # prose: its line breaks are no path's or name's

    def __post_init__(self) -> None:
        expand_user_options(self, "export_dir")
        self.commit_message = _stripped_message(self.commit_message)
        try:  # the Hub's own rules ('name' or 'owner/name'; letters, digits, '-', '_', '.'), before the export is read
            validate_repo_id(self.repo_id)
        except HFValidationError as error:
            raise ConfigurationError(
                f"--repo_id {self.repo_id!r} is not a valid Hub repository name: {error}"
            ) from None


def _stripped_message(message: str) -> str:
    """A commit message without its leading and trailing blank lines, as git strips one: its first line with text is
    the title (push makes it the Hub commit's summary), not the blank line before it. ConfigurationError for a message
    with no text, which the upload would replace with the library's default title without a word."""
    lines = message.splitlines()
    written = [index for index, line in enumerate(lines) if line.strip()]
    if not written:
        raise ConfigurationError(
            f"--commit_message {message!r} holds no text: write a title (a body may follow a line break), or leave "
            "the option out for the default"
        )
    return "\n".join(lines[written[0] : written[-1] + 1])


__all__ = ["FoldArguments", "PushArguments"]
