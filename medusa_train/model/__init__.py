"""The drafts on an unmodified backbone: Medusa heads (MedusaConfig, the heads, prefix attention, MedusaModel,
layouts) and the EAGLE-3 draft beside them (Eagle3Config, Eagle3Model)."""

from medusa_train.families.eagle3.config import Eagle3Config
from medusa_train.families.eagle3.model import Eagle3Model
from medusa_train.families.medusa.config import MedusaConfig
from medusa_train.families.medusa.model import MedusaModel, MedusaOutput

__all__ = ["Eagle3Config", "Eagle3Model", "MedusaConfig", "MedusaModel", "MedusaOutput"]
