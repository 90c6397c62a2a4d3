"""Make the folded model types known to ``AutoConfig``/``AutoModelForCausalLM`` through their public ``register``.

A folded export's ``config.json`` names a ``tapernorm_<family>`` model type. For
``AutoModelForCausalLM.from_pretrained(folder)`` to load it where hf_tapernorm is imported, ``AutoConfig``
must know that type. The real folded config class of a family subclasses the family's config, and
building it imports the family's configuration module: ``import hf_tapernorm`` must not pay for that for
every family in the table. So each type is first registered (``AutoConfig.register``) with a loader: a
config class of the same ``model_type`` that builds the real class on first use and hands over to it
(instantiation, ``from_dict``, ``from_pretrained``), registering the real class in its place. Model classes
register themselves (``AutoModelForCausalLM.register``) when the first config of their family is built
(``modeling_folded._post_init``).

The package registers the loaders right after transformers' Auto configuration module is imported
(``hf_tapernorm/_import_hooks.py``), or at once when it already was; nothing here reads or replaces
transformers' internal registry.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from ..architectures.table import ARCHITECTURES
from .modeling_folded import PREFIX

AUTO_CONFIG_MODULE = "transformers.models.auto.configuration_auto"
_lock = threading.Lock()


def _real_config_class(model_type: str) -> type:
    """Build the folded config class of ``model_type`` and register it in place of its loader."""
    from transformers import AutoConfig

    from .modeling_folded import folded_config_class

    config_class = folded_config_class(model_type)
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    return config_class


def _loader_class(model_type: str) -> type:
    """A config class for ``tapernorm_<model_type>`` that stands in for the real one until it is first used."""
    from transformers import PreTrainedConfig

    def __new__(cls, *args: Any, **kwargs: Any):  # noqa: N807 - the loader's constructor builds the real config
        return _real_config_class(model_type)(*args, **kwargs)

    def from_dict(cls, config_dict: dict, **kwargs: Any):
        return _real_config_class(model_type).from_dict(config_dict, **kwargs)

    def from_pretrained(cls, *args: Any, **kwargs: Any):
        return _real_config_class(model_type).from_pretrained(*args, **kwargs)

    return type(
        f"TaperNormConfigLoader_{model_type}",
        (PreTrainedConfig,),
        {
            "model_type": f"{PREFIX}{model_type}",
            "__module__": __name__,
            "__doc__": f"Builds the folded {model_type} config class on first use (hf_tapernorm.export.registration).",
            "__new__": __new__,
            "from_dict": classmethod(from_dict),
            "from_pretrained": classmethod(from_pretrained),
        },
    )


def register_lazily(model_types: Iterable[str] | None = None) -> None:
    """Register a loader for ``tapernorm_<type>`` of every table family (or ``model_types``) with AutoConfig,
    building no family's class now; a type already registered (a loader or the real class) is left as it is."""
    from transformers import CONFIG_MAPPING, AutoConfig

    with _lock:
        for model_type in ARCHITECTURES if model_types is None else model_types:
            key = f"{PREFIX}{model_type}"
            if key not in CONFIG_MAPPING:
                AutoConfig.register(key, _loader_class(model_type))


def register_folded_classes(model_types: Iterable[str] | None = None) -> None:
    """Register the folded config classes of ``model_types`` (default: every family of the architecture
    table) with AutoConfig now (idempotent). Folding a family registers it (discovered families included)."""
    for model_type in ARCHITECTURES if model_types is None else model_types:
        _real_config_class(model_type)


__all__ = ["AUTO_CONFIG_MODULE", "register_folded_classes", "register_lazily"]
