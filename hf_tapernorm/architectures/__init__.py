"""Architecture knowledge, the package's bottom layer: where each family's norms are, what they feed,
and their exact arithmetic. Nothing here imports the layers above (TaperNorm, training, folding).

The public names, for adding a model family (docs/adding_an_architecture.md):

- :data:`ARCHITECTURES`, :class:`Architecture`, :class:`NormSite`, :func:`register_architecture`,
  :func:`supported_model_types` (table.py): the table of known families, and how to add one;
- :class:`NormStyle` (styles.py): RMSNorm or LayerNorm arithmetic;
- :func:`discover_architecture`, :class:`DiscoveryError` (discovery.py): the description automatic
  discovery derives for a model type without an entry (the starting point of a new entry);
- :func:`architecture_of`, :func:`norm_sites` (sites.py): the description a model is patched with (table
  entry or discovery), and its norms with their qualified paths;
- :func:`norms_to_keep`, :func:`norms_feeding_gated_mlps` (recipe_rules.py): which norms the default
  recipe keeps as real norms, and why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "ARCHITECTURES": "table",
    "Architecture": "table",
    "NormSite": "table",
    "register_architecture": "table",
    "supported_model_types": "table",
    "NormStyle": "styles",
    "DiscoveryError": "discovery",
    "discover_architecture": "discovery",
    "architecture_of": "sites",
    "norm_sites": "sites",
    "norms_feeding_gated_mlps": "recipe_rules",
    "norms_to_keep": "recipe_rules",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .discovery import DiscoveryError, discover_architecture
    from .recipe_rules import norms_feeding_gated_mlps, norms_to_keep
    from .sites import architecture_of, norm_sites
    from .styles import NormStyle
    from .table import ARCHITECTURES, Architecture, NormSite, register_architecture, supported_model_types
