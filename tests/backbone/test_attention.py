"""Attention for a CPU decoding step (``medusa_train/backbone/attention.py``) where the step attention kernel does not
apply (``sdpa_paths``: as without a compiler; the kernel itself: ``test_step_attention.py``).

What it must hold: a verify step's hidden states bitwise those of transformers' own ``sdpa`` (which copies the keys
and values per query head), reached without those copies; a bf16 1-token step exactly float32 SDPA over the widened
tensors, rounded once; every other call (a float32 1-token step, autograd, a model without grouped heads)
transformers' own function; greedy decoding unchanged, ours and HF ``generate`` alike.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.backbones import make_tiny_backbone
from helpers.decoding import hf_greedy, install_oracle_heads, prompts
from transformers import AttentionInterface

from medusa_train import MedusaModel
from medusa_train.backbone import attention
from medusa_train.backbone.attention import (
    attention_for,
    grouped_sdpa_forward,
    transformers_sdpa,
    use_grouped_attention,
)
from medusa_train.decoding import TokenTree, tree_generate
from medusa_train.decoding.generate import tree_forward

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def registered():
    """Whatever ``sdpa`` was before the test is what it is after."""
    before = AttentionInterface._global_mapping["sdpa"]
    yield
    AttentionInterface.register("sdpa", before)


@pytest.fixture
def sdpa_paths(monkeypatch):
    """The step attention out of the way, as on a machine without a compiler (its kernel not built): ``use_grouped_
    attention(step_kernel=False)`` registers the SDPA paths alone, and this makes the default do the same."""
    monkeypatch.setattr(attention, "step_attention", lambda *args, **kwargs: None)
    monkeypatch.setattr(attention, "steps_taken", lambda head_dim=None: None)


@pytest.fixture
def delegated(monkeypatch):
    """How many calls the grouped function handed to transformers' own."""
    calls = []
    own = attention.sdpa_attention_forward
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: calls.append(a[1].shape[2]) or own(*a, **k))
    return calls


def _verify_hidden(model, tree: TokenTree, ids: torch.Tensor) -> torch.Tensor:
    """The backbone's pass over ``tree``'s nodes after the prompt ``ids`` (a fresh cache each call)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        tokens = torch.arange(3, 3 + tree.num_nodes)
        return tree_forward(model, tokens, tree.attention_mask(torch.float32), tree.position_offsets, cache,
                            ids.shape[1])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_verify_step_is_bitwise_transformers_sdpa_without_copying_the_cache(registered, sdpa_paths, delegated, arch):
    model = MedusaModel.from_backbone(make_tiny_backbone(arch, seed=5), num_heads=4).eval()
    ids = prompts(1, seed=2)[0]
    tree = TokenTree.from_name("default")
    transformers_sdpa()
    reference = _verify_hidden(model, tree, ids)
    use_grouped_attention()
    delegated.clear()
    got = _verify_hidden(model, tree, ids)
    assert torch.equal(got, reference)
    # the prefill (no 4D mask) went to transformers' function; the tree pass's layers did not
    assert delegated == [ids.shape[1]] * model.backbone.config.num_hidden_layers


def test_other_calls_are_transformers_own(registered, sdpa_paths, delegated):
    backbone = make_tiny_backbone("llama", seed=6)
    layer = backbone.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g)
    mask = torch.zeros(1, 1, 3, 9)
    grouped_sdpa_forward(layer, q[:, :, :1], k, v, mask[:, :, :1])  # one query token
    grouped_sdpa_forward(layer, q.requires_grad_(), k, v, mask)  # autograd
    grouped_sdpa_forward(layer, q.detach(), k, v, None)  # no mask
    assert delegated == [1, 3, 3]
    with torch.no_grad():
        out, _ = grouped_sdpa_forward(layer, q, k, v, mask)
        assert len(delegated) == 3 and out.shape == (1, 3, 4, 16)
        neox = make_tiny_backbone("gpt_neox").gpt_neox.layers[0].attention  # no grouped heads
        grouped_sdpa_forward(neox, torch.randn(1, 4, 3, 16), torch.randn(1, 4, 9, 16), torch.randn(1, 4, 9, 16), mask)
    assert len(delegated) == 4


def test_greedy_decoding_with_grouped_attention_is_plain_greedy(registered, sdpa_paths):
    """HF ``generate`` (its own masked steps included) gives what it gave before; ours stays token-identical to it."""
    backbone = make_tiny_backbone("llama", seed=4)
    transformers_sdpa()
    references = [hf_greedy(backbone, ids, 24, eos_token_id=1) for ids in prompts(3, seed=9)]
    use_grouped_attention()
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    for ids, reference in zip(prompts(3, seed=9), references):
        assert hf_greedy(backbone, ids, 24, eos_token_id=1).tolist() == reference.tolist()
        install_oracle_heads(model, reference)  # long accepted paths: many-node verifies on the grouped path
        out = tree_generate(model, ids, TokenTree.from_name("default"), max_new_tokens=24, eos_token_id=1)
        assert out.sequences.tolist() == reference.tolist()
        assert max(out.accept_lengths) >= 3


def test_a_bf16_one_token_step_attends_in_float32(registered, sdpa_paths, delegated):
    """torch's CPU SDPA in bf16 takes ~5x float32's time at one query token (``docs/results.md``, "Step cost"): such a
    step attends in float32 and rounds once, with or without a mask, grouped heads or not; a cached reply names it."""
    backbone = make_tiny_backbone("llama", seed=6)
    layer = backbone.model.layers[0].self_attn
    neox = make_tiny_backbone("gpt_neox").gpt_neox.layers[0].attention  # no grouped heads
    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(1, 1, 1, 9, dtype=torch.bfloat16)
    mask[..., 2] = torch.finfo(torch.bfloat16).min  # one cached position hidden
    with torch.no_grad():
        for module, heads in ((layer, 2), (neox, 4)):
            q = torch.randn(1, 4, 1, 16, generator=g).bfloat16()
            k, v = (torch.randn(1, heads, 9, 16, generator=g).bfloat16() for _ in range(2))
            for m in (None, mask):
                out, _ = grouped_sdpa_forward(module, q, k, v, m)
                wide = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                      attn_mask=None if m is None else m.float(), enable_gqa=heads == 2)
                assert out.dtype == torch.bfloat16 and torch.equal(out, wide.bfloat16().transpose(1, 2))
                own, _ = attention.sdpa_attention_forward(module, q, k, v, m)  # torch's bf16 kernel
                assert torch.allclose(out.float(), own.float(), rtol=2 ** -7, atol=2 ** -7)
        assert len(delegated) == 4  # only the comparisons' own calls
        grouped_sdpa_forward(layer, q.float(), k.float(), v.float(), None)  # float32: transformers' own
    assert len(delegated) == 5
    use_grouped_attention()
    assert attention_for("cpu", torch.bfloat16) == "sdpa, CPU steps: grouped, 1 token in float32"
    assert attention_for("cpu", torch.float32) == "sdpa, CPU steps: grouped"
    assert attention_for("cuda", torch.bfloat16) == "sdpa"
    transformers_sdpa()
    assert attention_for("cpu", torch.bfloat16) == "sdpa"
