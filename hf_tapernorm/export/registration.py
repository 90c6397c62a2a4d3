"""Make the folded model types known to ``AutoConfig``/``AutoModelForCausalLM`` through their public ``register``.

A folded export's ``config.json`` names a ``tapernorm_<family>`` model type. For
``AutoModelForCausalLM.from_pretrained(folder)`` to load it where hf_tapernorm is imported, ``AutoConfig``
must know that type. The real folded config class of a family subclasses the family's config, and
building it imports the family's configuration module: ``import hf_tapernorm`` must not pay for that for
every family. So the type of every family transformers knows (the table's, and those folded through automatic
discovery, whose exports load the same way) is first registered (``AutoConfig.register``) with a loader: a
config class of the same ``model_type`` that builds the real class on first use and hands over to it
(instantiation, ``from_dict``, ``from_pretrained``), registering the real class in its place. Model classes
register themselves (``AutoModelForCausalLM.register``) when the first config of their family is built
(``modeling_folded._post_init``). With the real config class, each of ``OTHER_HEADS`` (``AutoModel``,
``AutoModelForSequenceClassification``, ...) gets a stand-in that refuses the export in one line: an export loads as
a causal LM only.

The package registers the loaders right after transformers' Auto configuration module is imported
(``hf_tapernorm/_import_hooks.py``), or at once when it already was; nothing here reads or replaces
transformers' internal registry.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from typing import Any

from ..architectures.table import ARCHITECTURES
from ..errors import UnsupportedModelError
from .modeling_folded import PREFIX

AUTO_CONFIG_MODULE = "transformers.models.auto.configuration_auto"
_lock = threading.Lock()


def _real_config_class(model_type: str) -> type:
    """Build the folded config class of ``model_type`` and register it in place of its loader."""
    from transformers import AutoConfig

    from .modeling_folded import folded_config_class

    config_class = folded_config_class(model_type)
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    _register_other_heads(config_class)
    return config_class


#: The Auto classes a user may try on an export besides AutoModelForCausalLM; each gets a one-line refusal.
OTHER_HEADS = (
    "AutoModel",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering",
)


def _register_other_heads(config_class: type) -> None:
    """Register, for each of ``OTHER_HEADS``, a stand-in that refuses an export in one line (``AutoX.register``).

    An export is a causal LM with its norms folded into the head and the stored sink in its forward; no other head
    or bare base model of it exists, and transformers' own answer ("Unrecognized configuration class ...") lists
    every type it knows without saying so. Where the stand-in is not registered, that answer is the same failure.
    """
    import transformers

    for head in OTHER_HEADS:
        getattr(transformers, head).register(config_class, _refusal_class(head, config_class), exist_ok=True)


def _refusal_class(head: str, config_class: type) -> type:
    """A class registered for ``head`` and ``config_class`` whose loading and building raise the one-line refusal."""

    def from_pretrained(cls, source: Any = None, *args: Any, **kwargs: Any):
        raise _not_a_causal_lm(head, str(source), config_class.model_type)

    def _from_config(cls, config: Any, **kwargs: Any):  # what AutoX.from_config calls
        raise _not_a_causal_lm(head, str(getattr(config, "name_or_path", "") or "the config"), config_class.model_type)

    return type(
        f"{config_class.__name__}Refusal{head[len('AutoModel') :] or 'Model'}",
        (),
        {
            "config_class": config_class,
            "__module__": __name__,
            "__doc__": f"Refuses {head} for {config_class.model_type} in one line (hf_tapernorm.export.registration).",
            "from_pretrained": classmethod(from_pretrained),
            "_from_config": classmethod(_from_config),
        },
    )


def _not_a_causal_lm(head: str, source: str, model_type: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{head}: '{source}' is a folded export ({model_type}), which loads as a causal LM only: use "
        f"AutoModelForCausalLM.from_pretrained('{source}'), and for its hidden states call it with "
        "output_hidden_states=True"
    )


@functools.cache
def _loader_base() -> type:
    """The one base of every loader: a config class that builds the real folded class of its type when used.

    transformers turns each config subclass into a dataclass (``PreTrainedConfig.__init_subclass__``), the costly
    part of building a class; a loader is never instantiated (its ``__new__`` returns the real class's config),
    so its subclasses skip that step, and registering one for every type transformers knows stays cheap.
    """
    from transformers import PreTrainedConfig

    class TaperNormConfigLoader(PreTrainedConfig):
        """Builds the folded config class of ``base_model_type`` on first use (hf_tapernorm.export.registration)."""

        base_model_type = ""

        def __init_subclass__(cls, **kwargs: Any) -> None:  # no dataclass: the loader never holds fields
            pass

        def __new__(cls, *args: Any, **kwargs: Any):
            return _real_config_class(cls.base_model_type)(*args, **kwargs)

        @classmethod
        def from_dict(cls, config_dict: dict, **kwargs: Any):
            return _real_config_class(cls.base_model_type).from_dict(config_dict, **kwargs)

        @classmethod
        def from_pretrained(cls, *args: Any, **kwargs: Any):
            return _real_config_class(cls.base_model_type).from_pretrained(*args, **kwargs)

    TaperNormConfigLoader.__module__, TaperNormConfigLoader.__qualname__ = __name__, "TaperNormConfigLoader"
    return TaperNormConfigLoader


def _loader_class(model_type: str) -> type:
    """A config class for ``tapernorm_<model_type>`` that stands in for the real one until it is first used."""
    return type(
        f"TaperNormConfigLoader_{model_type}",
        (_loader_base(),),
        {"model_type": f"{PREFIX}{model_type}", "base_model_type": model_type, "__module__": __name__},
    )


def _known_base_types() -> list[str]:
    """Every model type transformers' AutoConfig knows now, less the folded types themselves.

    A family outside the architecture table is folded through automatic discovery, so an export can name the folded
    type of any family transformers has; which of them have a causal-LM class is known only to transformers'
    modeling Auto module, which may still be importing when the loaders are registered.
    """
    from transformers import CONFIG_MAPPING

    return [model_type for model_type in CONFIG_MAPPING if not model_type.startswith(PREFIX)]


def register_lazily(model_types: Iterable[str] | None = None) -> None:
    """Register a loader for ``tapernorm_<type>`` of every type AutoConfig knows (or of ``model_types``),
    building no family's class now; a type already registered (a loader or the real class) is left as it is."""
    from transformers import CONFIG_MAPPING, AutoConfig

    with _lock:
        for model_type in _known_base_types() if model_types is None else model_types:
            key = f"{PREFIX}{model_type}"
            if key not in CONFIG_MAPPING:
                AutoConfig.register(key, _loader_class(model_type))


def register_folded_classes(model_types: Iterable[str] | None = None) -> None:
    """Register the folded config classes of ``model_types`` (default: every family of the architecture
    table) with AutoConfig now (idempotent). Folding a family registers it (discovered families included)."""
    for model_type in ARCHITECTURES if model_types is None else model_types:
        _real_config_class(model_type)


__all__ = ["AUTO_CONFIG_MODULE", "register_folded_classes", "register_lazily"]
