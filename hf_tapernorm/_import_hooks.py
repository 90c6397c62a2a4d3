"""Run a function right after a module is first imported: a one-shot meta-path finder.

Used by ``import hf_tapernorm`` to register the folded model classes with transformers' Auto classes
only once transformers' own Auto machinery is imported (export/registration.py), so that importing the
package costs nothing it does not need.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable
from typing import Any


class _Loader(importlib.abc.Loader):
    """Delegates to the real loader and runs ``callback`` once the module has executed."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[], None]) -> None:
        self._loader, self._callback = loader, callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        try:
            self._callback()
        except Exception as error:  # never break the user's import of transformers
            warnings.warn(f"hf_tapernorm could not register its folded model classes: {error}", stacklevel=2)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """A one-shot meta-path finder: finds ``name`` with the other finders and wraps its loader."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self.callback)
        return spec


def run_after_import(module_name: str, callback: Callable[[], None]) -> None:
    """Call ``callback`` now if ``module_name`` is imported, else right after its first import (once)."""
    if module_name in sys.modules:
        callback()
    elif not any(isinstance(f, _AfterImport) and f.name == module_name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(module_name, callback))


__all__ = ["run_after_import"]
