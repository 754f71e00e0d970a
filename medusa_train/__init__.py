"""medusa-train: train, export and measure Medusa decoding heads (and EAGLE-3 drafts) on any Hugging Face causal LM.

The folders follow the data flow: ``config`` -> ``backbone`` -> ``model`` -> ``engine`` -> ``data`` ->
``training`` | ``decoding`` -> ``export`` -> ``tree`` -> ``evaluation`` -> ``cli``; no module imports from a
later stage (tests/test_layout.py).
"""

from medusa_train.backbone import load_backbone, load_tokenizer
from medusa_train.decoding import TokenTree, tree_generate
from medusa_train.model import Eagle3Config, Eagle3Model, MedusaConfig, MedusaModel, MedusaOutput

__all__ = ["load_backbone", "load_tokenizer", "Eagle3Config", "Eagle3Model", "MedusaConfig", "MedusaModel",
           "MedusaOutput", "TokenTree", "tree_generate"]
