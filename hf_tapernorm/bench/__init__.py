"""The benchmark (``hf-tapernorm bench``): what removing the norms buys at inference, and what the default
recipe costs per training step, measured side by side in one run. ``runner.main`` is the entry point;
the modules it wires together are listed in runner.py."""
