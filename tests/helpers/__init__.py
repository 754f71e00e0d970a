"""Shared test helpers (not tests): tiny backbones, tokenizers, training setups. Test modules import
from here and never from each other; conftest.py files turn some of these into fixtures."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (train.py, scripts/, notebooks/, configs/)
