"""Self-distillation: the backbone answers the training prompts itself."""
