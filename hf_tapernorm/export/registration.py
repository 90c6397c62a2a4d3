"""Make the folded model types known to ``AutoConfig``/``AutoModelForCausalLM`` without paying for it at import.

A folded export's ``config.json`` names a ``tapernorm_<family>`` model type. For
``AutoModelForCausalLM.from_pretrained(folder)`` to load it where hf_tapernorm is imported, ``AutoConfig``
must know that type. Building the folded config classes means importing each family's configuration
module, which ``import hf_tapernorm`` must not cost, and which cannot even happen while transformers is
still importing its Auto machinery (the configuration modules need it complete). So the types are
registered lazily: right after transformers' ``configuration_auto`` module is imported (or at once, when
it already was), its registry of extra types learns the names and how to build each class; a class is
built on the first lookup, which happens inside ``from_pretrained``, when every import is done. Model
classes register themselves when the first config of their family is built (``modeling_folded._post_init``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from ..architectures.table import ARCHITECTURES
from .modeling_folded import PREFIX

AUTO_CONFIG_MODULE = "transformers.models.auto.configuration_auto"
_lock = threading.Lock()


class _LazyClasses(dict):
    """``CONFIG_MAPPING._extra_content`` that builds a registered class on its first lookup.

    transformers' config registry reads its extra entries with ``in``, ``[]``, ``keys()``, ``values()`` and
    ``items()``; each sees the pending entries as if they were there.
    """

    def __init__(self, existing: dict) -> None:
        super().__init__(existing)
        self.pending: dict[str, Callable[[], type]] = {}

    def _build(self, key: str) -> None:
        if key in self.pending and not dict.__contains__(self, key):
            dict.__setitem__(self, key, self.pending.pop(key)())

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or key in self.pending

    def __getitem__(self, key: str) -> type:
        self._build(key)
        return dict.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default  # noqa: SIM401 - dict.get would skip the pending entries

    def _build_all(self) -> None:
        for key in list(self.pending):
            self._build(key)

    def keys(self):
        return list(dict.keys(self)) + [k for k in self.pending if not dict.__contains__(self, k)]

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def values(self):
        self._build_all()
        return dict.values(self)

    def items(self):
        self._build_all()
        return dict.items(self)


def _config_registry() -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING


def register_lazily(model_types: Iterable[str] | None = None) -> None:
    """Make ``tapernorm_<type>`` of every table family (or ``model_types``) known to AutoConfig, building
    nothing now. Falls back to :func:`register_folded_classes` if transformers' registry is not the expected
    dict (a transformers version this code does not know)."""
    registry = _config_registry()
    from .modeling_folded import folded_config_class

    with _lock:
        extra = getattr(registry, "_extra_content", None)
        if not isinstance(extra, dict):
            register_folded_classes(model_types)
            return
        if not isinstance(extra, _LazyClasses):
            extra = _LazyClasses(extra)
            registry._extra_content = extra
        for model_type in ARCHITECTURES if model_types is None else model_types:
            key = f"{PREFIX}{model_type}"
            if key not in extra:
                extra.pending[key] = partial(folded_config_class, model_type)


def register_folded_classes(model_types: Iterable[str] | None = None) -> None:
    """Register the folded config classes of ``model_types`` (default: every family of the architecture
    table) with AutoConfig now (idempotent). Folding a family registers it (discovered families included)."""
    from transformers import AutoConfig

    from .modeling_folded import folded_config_class

    for model_type in ARCHITECTURES if model_types is None else model_types:
        config_class = folded_config_class(model_type)
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)


__all__ = ["AUTO_CONFIG_MODULE", "register_folded_classes", "register_lazily"]
