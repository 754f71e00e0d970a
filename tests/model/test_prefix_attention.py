"""Heads that read through a prefix attention layer (``heads.prefix_attention``): the layer's formula,
its zero start, causality, its decode cache, the round trip, and the layouts that cannot hold it.
Decoding, calibration and training with it are in test_next_token_input.py and tests/data/test_capture.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.backbones import make_tiny_backbone
from helpers.heads import randomise

from medusa_train import MedusaModel
from medusa_train.backbone.step_attention import steps_taken
from medusa_train.families.medusa import prefix_attention
from medusa_train.families.medusa.export import export_heads
from medusa_train.families.medusa.layouts import read_heads
from medusa_train.families.medusa.model import load_heads_strict
from medusa_train.families.medusa.prefix_attention import PrefixAttention

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def randomise_prefix(model: MedusaModel) -> MedusaModel:
    return randomise(model, scale=0.2, part="prefix")


def reference_layer(layer: PrefixAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer written out position by position: (seq, hidden) -> (seq, hidden)."""
    heads, size = layer.num_attention_heads, x.shape[-1]
    d = size // heads

    def rms(v, weight):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    q, k, v = (rms(x, layer.attn_norm.weight) @ layer.qkv.weight.T).split(size, dim=-1)
    rows = []
    for t in range(x.shape[0]):
        attended = []
        for h in range(heads):
            part = slice(h * d, (h + 1) * d)
            scores = torch.stack([q[t, part] @ k[j, part] / math.sqrt(d) for j in range(t + 1)])
            weights = scores.softmax(0)
            attended.append(sum(w * v[j, part] for j, w in enumerate(weights)))
        rows.append(x[t] + layer.out.weight @ torch.cat(attended))
    y = torch.stack(rows)
    gate, up = (rms(y, layer.mlp_norm.weight) @ layer.gate_up.weight.T).chunk(2, dim=-1)
    return y + (F.silu(gate) * up) @ layer.down.weight.T


def test_fresh_layer_is_the_identity_so_fresh_heads_reproduce_the_lm_head(tiny_backbone):
    model = MedusaModel.from_backbone(tiny_backbone, num_heads=2, next_token_input=True, path_input=True,
                                      prefix_attention=True)
    assert (model.config.prefix_attention_heads, model.config.prefix_intermediate_size) == (4, 128)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        out = model(ids, return_base_logits=True)
        context = model.prefix(out.hidden_states)
        assert torch.equal(context, out.hidden_states)
        inputs = model.head_features(out.hidden_states)
        for k in range(2):
            assert torch.equal(model.head_logits(inputs, k), out.base_logits)


def test_the_layer_is_causal_pre_norm_attention_then_a_gated_mlp(tiny_llama):
    model = randomise_prefix(MedusaModel.from_backbone(tiny_llama, num_heads=1, prefix_attention=True))
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model.head_features(x)
        for b in range(2):
            torch.testing.assert_close(out[b], reference_layer(model.prefix, x[b]), rtol=1e-5, atol=1e-5)
        # a position sees itself and what comes before it, nothing after: right padding changes nothing
        changed = x.clone()
        changed[:, 4:] = torch.randn(2, 3, 64)
        assert torch.equal(model.head_features(changed)[:, :4], out[:, :4])
        assert not torch.allclose(model.head_features(changed)[:, 4:], out[:, 4:])


@pytest.mark.parametrize("hidden", [64, 128])
@pytest.mark.parametrize("chunks", [[7], [1] * 7, [3, 1, 2, 1], [2, 5]])
def test_the_decode_cache_continues_the_sequence(chunks, hidden, monkeypatch):
    """Feeding the positions a few at a time (prompt, then each step's accepted tokens) through the
    decode state gives, at each step's last position, what one pass over the whole sequence gives. Heads of 16
    (SDPA) and of 32 (on an AVX2/AVX-512 CPU the step attention takes the steps after the prompt)."""
    backbone = make_tiny_backbone("llama", hidden_size=hidden)
    model = randomise_prefix(MedusaModel.from_backbone(backbone, num_heads=1, prefix_attention=True))
    x = torch.randn(7, hidden, generator=torch.Generator().manual_seed(5))
    state = model.new_decode_state()
    taken = []
    kernel = prefix_attention.step_attention
    monkeypatch.setattr(prefix_attention, "step_attention", lambda *a: taken.append(kernel(*a) is not None) or kernel(*a))
    with torch.no_grad():
        whole = model.head_features(x)
        parts, start = [], 0
        for n in chunks:
            parts.append(model.head_features(x[start:start + n], None, state))
            start += n
            assert state.prefix_cache.get_seq_length() == start
            assert torch.equal(model.head_features(None, None, state), parts[-1])  # asking again reads nothing new
    # float32 rounding only (one-row and many-row sums part at ~1e-5 on AVX2 code; a wrong key or mask: ~1e-1)
    torch.testing.assert_close(torch.cat(parts), whole[[sum(chunks[:i + 1]) - 1 for i in range(len(chunks))]],
                               rtol=1e-4, atol=5e-5)
    assert len(taken) == len(chunks) - 1  # each step after the prompt
    kind = steps_taken(32)  # "all", "1 query" (an AVX2 build) or None
    assert taken == [hidden == 128 and (kind == "all" or kind == "1 query" and n == 1) for n in chunks[1:]]


def test_round_trip_and_layouts_that_cannot_hold_it(tmp_path, tiny_llama):
    model = randomise_prefix(MedusaModel.from_backbone(tiny_llama, num_heads=2, prefix_attention=True))
    model.save_pretrained(tmp_path / "heads")
    export_heads(model, tmp_path / "native", format="native")
    for folder in ("heads", "native"):
        loaded = MedusaModel.from_pretrained(tmp_path / folder, backbone=tiny_llama)
        assert loaded.config == model.config
        assert loaded.heads_state_dict().keys() == model.heads_state_dict().keys()
        for name, tensor in model.heads_state_dict().items():
            assert torch.equal(loaded.heads_state_dict()[name], tensor), name
    assert any(name.startswith("prefix.") for name in model.heads_state_dict())
    for layout in ("medusa_v1", "vllm"):
        with pytest.raises(ValueError, match="prefix attention"):
            export_heads(model, tmp_path / layout, format=layout)
    config, tensors = read_heads(tmp_path / "heads")
    del tensors["prefix.qkv.weight"]
    with pytest.raises(ValueError, match=r"missing tensors: prefix\.qkv\.weight"):
        load_heads_strict(MedusaModel(tiny_llama, config), tensors, "test")


def test_layer_needs_heads_that_divide_the_hidden_size():
    with pytest.raises(ValueError, match="attention heads do not divide hidden size 64"):
        PrefixAttention(64, 5, 128)
