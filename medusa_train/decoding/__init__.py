"""Tree-attention speculative decoding with Medusa heads: trees, the decoder, acceptance rules."""

from medusa_train.decoding.acceptance import ACCEPTANCE_METHODS, Acceptance
from medusa_train.decoding.generate import TreeGenerateOutput, tree_generate
from medusa_train.decoding.tree import TokenTree, tree_from_config

__all__ = ["ACCEPTANCE_METHODS", "Acceptance", "TreeGenerateOutput", "TokenTree", "tree_generate",
           "tree_from_config"]
