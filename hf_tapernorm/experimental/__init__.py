"""Research code with a lower API promise than the stable package: token-scale penalties and per-layer
diagnostics used by the fidelity experiments (docs/fidelity.md). May change or go without a deprecation;
no stable module imports it."""
