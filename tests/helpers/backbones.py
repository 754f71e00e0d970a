"""Tiny random backbones of real architectures, built in-process (nothing downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

PACKAGED_MODEL = "packaged:smollm2-135m-instruct"
TINY_VOCAB = 256


def make_tiny_backbone(arch: str = "llama", seed: int = 0, vocab_size: int = TINY_VOCAB, hidden_size: int = 64,
                       tie: bool = False, attn_implementation: str = "sdpa", layers: int = 2):
    """A small random causal LM of a real architecture, float32, eval mode, frozen."""
    torch.manual_seed(seed)
    common = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                  num_attention_heads=4, vocab_size=vocab_size, max_position_embeddings=512,
                  tie_word_embeddings=tie, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **common))
    elif arch == "gpt_neox":
        model = GPTNeoXForCausalLM(GPTNeoXConfig(**common))
    else:
        raise ValueError(arch)
    model.config._attn_implementation = attn_implementation
    model.name_or_path = f"tiny-{arch}"
    return model.eval().requires_grad_(False)


def load_with_tokenizerless(load_backbone, path: Path):
    """A tiny backbone folder has no tokenizer; give it the smallest real one we can build offline
    (word level, ``t0`` .. ``t255``), then load the folder with ``load_backbone``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t0").save_pretrained(path)
    return load_backbone(path, dtype="float32")


CACHE_KINDS = {  # transformers config class and options: a sliding window, then three kinds of running state
    "mistral, sliding window 16": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=16)),
    "qwen3-next, linear attention": ("Qwen3NextConfig", dict(
        num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)),
    "lfm2, short convolutions": ("Lfm2Config", dict(num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2)),
    "falcon-h1, attention and mamba in each layer": ("FalconH1Config", dict(
        num_hidden_layers=2, mamba_n_heads=4, mamba_d_head=32, mamba_d_ssm=128, mamba_d_state=16, mamba_n_groups=1,
        mamba_chunk_size=16, head_dim=16)),
}


def make_cache_kind_backbone(name: str):
    """A tiny random causal LM of ``CACHE_KINDS[name]`` (vocabulary 300, float32, eval mode)."""
    import transformers

    config, options = CACHE_KINDS[name]
    torch.manual_seed(0)
    tiny = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config)(**tiny, **options))
    return model.eval().requires_grad_(False)
