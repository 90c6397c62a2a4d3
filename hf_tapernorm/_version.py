"""The package version (read by setup.cfg and recorded in every folded export)."""

__version__ = "0.2.0"
