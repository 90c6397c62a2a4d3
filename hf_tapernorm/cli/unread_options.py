"""The Trainer options ``hf-tapernorm taper`` never reads: each is declared again with default ``None`` (so that
giving it at all, even at the Trainer's own default, shows), and given, it is refused in one line naming what does
its job, not ignored. ``TaperTrainingArguments`` (arguments.py) derives from :class:`TrainerOptionsNotRead`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from transformers import TrainingArguments

from ..errors import ConfigurationError

#: Why the Hub options are not read: taper refuses --push_to_hub, their only reader; a token given anyway would
#: still be pickled into every checkpoint's training_args.bin.
_NO_PUSH = "taper never pushes (--push_to_hub is refused); publish the folded export with hf-tapernorm push"


def _not_read(text: str) -> dict:
    """A refused option's metadata: its help says it is not read, and why."""
    return {"help": f"Not read: {text}."}


@dataclass
class TrainerOptionsNotRead(TrainingArguments):
    """TrainingArguments whose options taper never reads default to ``None``: :meth:`refuse_not_read` refuses each
    that was given."""

    num_train_epochs: Optional[float] = field(
        default=None, metadata=_not_read("a run's length is --max_steps optimizer steps")
    )
    per_device_eval_batch_size: Optional[int] = field(
        default=None, metadata=_not_read("taper evaluates with --eval_batch_size blocks per forward")
    )
    hub_token: Optional[str] = field(default=None, metadata=_not_read(f"{_NO_PUSH} (its --token)"))
    hub_model_id: Optional[str] = field(default=None, metadata=_not_read(f"{_NO_PUSH} (its --repo_id)"))
    hub_private_repo: Optional[bool] = field(default=None, metadata=_not_read(f"{_NO_PUSH} (its --private)"))
    hub_strategy: Optional[str] = field(default=None, metadata=_not_read(_NO_PUSH))
    hub_always_push: Optional[bool] = field(default=None, metadata=_not_read(_NO_PUSH))
    hub_revision: Optional[str] = field(default=None, metadata=_not_read(_NO_PUSH))

    #: Trainer options taper never reads (its own option or command does their job): given, they are refused.
    NOT_READ: ClassVar[dict[str, str]] = {
        "num_train_epochs": "a run's length is --max_steps optimizer steps (the Trainer ignores epochs once it is set)",
        "per_device_eval_batch_size": "taper evaluates the held-out blocks itself, --eval_batch_size per forward",
        "hub_token": f"{_NO_PUSH} --token",
        "hub_model_id": f"{_NO_PUSH} --repo_id",
        "hub_private_repo": f"{_NO_PUSH} (private unless --no_private)",
        "hub_strategy": _NO_PUSH,
        "hub_always_push": _NO_PUSH,
        "hub_revision": _NO_PUSH,
    }

    def refuse_not_read(self) -> None:
        """Refuse the first option of :attr:`NOT_READ` that was given, else set each back to the Trainer's default
        (which the rest of TrainingArguments expects)."""
        for name, instead in self.NOT_READ.items():
            if getattr(self, name) is not None:
                raise ConfigurationError(f"--{name} is not read by taper: {instead}; leave it out")
            setattr(self, name, TrainingArguments.__dataclass_fields__[name].default)


__all__ = ["TrainerOptionsNotRead"]
