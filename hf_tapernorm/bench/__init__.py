"""The benchmark: what removing the norms buys, measured side by side in one run (runner.py)."""
