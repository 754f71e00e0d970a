"""Weights moved away from their initialisation, so every head (and layer) differs and gets a gradient."""

from __future__ import annotations

import torch


def randomise(model, seed: int = 0, scale: float = 0.3, part: str = "heads"):
    """Noise on the weights of ``model.heads`` (or ``model.prefix``), away from their zero start."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in getattr(model, part).parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model

