"""PEP 562 lazy exports: a package names its public API without importing the modules that define it.

The facade (``hf_tapernorm``) and each documented subpackage (``hf_tapernorm.architectures``, ``.layers``,
``.training``, ``.export``) list their names here, so ``import hf_tapernorm`` stays cheap and importing one
submodule (which runs its package's ``__init__``) never drags in its siblings: export/registration.py is
imported while transformers is still setting up its Auto classes, when its siblings could not be.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps a public name to the submodule
    (relative to ``package``) that defines it; a name resolves on first use and is cached in the package."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__


__all__ = ["lazy_exports"]
