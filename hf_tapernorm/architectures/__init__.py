"""Architecture knowledge, the package's bottom layer: where each family's norms are, what they feed,
and their exact arithmetic. Nothing here imports the layers above (TaperNorm, training, folding)."""
