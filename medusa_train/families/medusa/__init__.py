"""Medusa heads: extra heads on the backbone's last hidden state, each guessing a token further ahead."""
