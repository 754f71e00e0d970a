"""Tree-attention speculative decoding with Medusa heads: trees, the decoder, acceptance rules."""

from medusa_train.decoding.acceptance import ACCEPTANCE_METHODS, Acceptance
from medusa_train.decoding.generate import MedusaGenerateOutput, medusa_generate
from medusa_train.decoding.tree import MedusaTree, tree_from_config

__all__ = ["ACCEPTANCE_METHODS", "Acceptance", "MedusaGenerateOutput", "MedusaTree", "medusa_generate",
           "tree_from_config"]
