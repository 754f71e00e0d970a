"""Command-line plumbing: one Hydra entry helper and one small module per command."""
