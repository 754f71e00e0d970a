"""The drafts on an unmodified backbone: Medusa heads (MedusaConfig, the heads, prefix attention, MedusaModel,
layouts) and the EAGLE-3 draft beside them (Eagle3Config, Eagle3Model)."""

from medusa_train.model.config import MedusaConfig
from medusa_train.model.eagle3 import Eagle3Config
from medusa_train.model.eagle3_model import Eagle3Model
from medusa_train.model.medusa import MedusaModel, MedusaOutput

__all__ = ["Eagle3Config", "Eagle3Model", "MedusaConfig", "MedusaModel", "MedusaOutput"]
