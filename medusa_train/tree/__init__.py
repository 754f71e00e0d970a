"""The tree stage: calibrate (head accuracies), cost (timed step costs), fit (the most likely paths) and
size (``nodes=auto``: the size with the most expected tokens/s), as ``medusa-train build-tree`` runs them."""
