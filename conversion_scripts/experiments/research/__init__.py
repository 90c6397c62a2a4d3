"""Research helpers of the fidelity experiments (docs/fidelity.md): token-scale penalties, per-layer
diagnostics and the batch-based linear fit. They live here, outside the installed package, because they
were measured no better than the product's recipe and carry no API promise; the package never imports them."""
