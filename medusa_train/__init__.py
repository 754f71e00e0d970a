"""medusa-train: train, export and measure Medusa decoding heads on any Hugging Face causal LM."""

from .backbone import load_backbone, load_tokenizer
from .formats import MedusaConfig
from .model import MedusaModel, MedusaOutput

__all__ = ["load_backbone", "load_tokenizer", "MedusaConfig", "MedusaModel", "MedusaOutput"]

try:  # the decoder lands in its own package; keep the top-level names stable
    from .decoding import MedusaTree, medusa_generate  # noqa: F401

    __all__ += ["MedusaTree", "medusa_generate"]
except ImportError:  # pragma: no cover - only while decoding/ is being written
    pass
