"""Loading a backbone (HF folder | hub id | .gguf | packaged:NAME), packaged assets, LoRA and 4-bit, plain generation."""

from medusa_train.backbone.load import DTYPES, load_backbone, load_tokenizer

__all__ = ["DTYPES", "load_backbone", "load_tokenizer"]
