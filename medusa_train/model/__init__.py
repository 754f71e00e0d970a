"""Medusa heads on an unmodified backbone: MedusaConfig, the heads, prefix attention, MedusaModel, layouts."""

from medusa_train.model.config import MedusaConfig
from medusa_train.model.medusa import MedusaModel, MedusaOutput

__all__ = ["MedusaConfig", "MedusaModel", "MedusaOutput"]
