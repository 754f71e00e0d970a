"""Tree-attention speculative decoding with Medusa heads: trees, the decoder, acceptance rules."""

from .acceptance import ACCEPTANCE_METHODS, Acceptance
from .generate import MedusaGenerateOutput, medusa_generate
from .tree import MedusaTree, build_tree, tree_from_config

__all__ = ["ACCEPTANCE_METHODS", "Acceptance", "MedusaGenerateOutput", "MedusaTree", "build_tree",
           "medusa_generate", "tree_from_config"]
