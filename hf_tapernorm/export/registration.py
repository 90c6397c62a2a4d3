"""Make the folded model types known to ``AutoConfig``/``AutoModelForCausalLM`` without paying for it at import.

A folded export's ``config.json`` names a ``tapernorm_<family>`` model type. For
``AutoModelForCausalLM.from_pretrained(folder)`` to load it where hf_tapernorm is imported, the folded
config classes must be registered with ``AutoConfig``; registering them means importing transformers'
configuration machinery (seconds), which ``import hf_tapernorm`` must not cost. So importing the package
only installs a one-shot import hook: registration runs right after transformers' own
``configuration_auto`` module is first imported, which happens before any Auto class can read a config
(or at once, when it already was). Model classes register themselves when the first config of their
family is built (``modeling_folded._post_init``).
"""

from __future__ import annotations

import threading
from typing import Any

from .._import_hooks import run_after_import

AUTO_CONFIG_MODULE = "transformers.models.auto.configuration_auto"
_lock = threading.Lock()
_registered: set[str] = set()


def register_folded_classes(model_types: Any = None) -> None:
    """Register the folded config classes of ``model_types`` (default: every family of the architecture
    table) with AutoConfig; idempotent. Folding a family registers it too (discovered families included)."""
    from transformers import AutoConfig

    from ..architectures.table import ARCHITECTURES
    from .modeling_folded import folded_config_class

    with _lock:
        for model_type in ARCHITECTURES if model_types is None else model_types:
            if model_type in _registered:
                continue
            config_class = folded_config_class(model_type)
            AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
            _registered.add(model_type)


def install_registration_hook() -> None:
    """Register now if transformers' Auto classes are already imported, else right after they are."""
    run_after_import(AUTO_CONFIG_MODULE, register_folded_classes)


__all__ = ["AUTO_CONFIG_MODULE", "install_registration_hook", "register_folded_classes"]
