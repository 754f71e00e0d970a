"""Shared fixtures: tiny random backbones built in-process, and the packaged real model (slow)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
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
                       tie: bool = False, attn_implementation: str = "sdpa"):
    """A small random causal LM of a real architecture, float32, eval mode, frozen."""
    torch.manual_seed(seed)
    common = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
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


@pytest.fixture
def one_thread():
    """One torch thread: tiny models gain nothing from more, and on a shared CPU two OpenMP
    threads per process crawl (measured: ~7x slower generation steps under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["llama", "qwen2"])
def tiny_backbone(request):
    """Two architectures, so nothing silently depends on Llama's module names."""
    return make_tiny_backbone(request.param)


@pytest.fixture
def tiny_llama():
    return make_tiny_backbone("llama")


@pytest.fixture(scope="session")
def packaged_backbone():
    """The real packaged SmolLM2-135M-Instruct in float32 (slow: first use converts it, ~20 s)."""
    from medusa_train import load_backbone

    return load_backbone(PACKAGED_MODEL, dtype="float32")
