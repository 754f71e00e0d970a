"""Weights moved away from their initialisation, so every head (and layer) differs and gets a gradient."""

from __future__ import annotations

import torch


def randomise(model, seed: int = 0, scale: float = 0.3, part: str = "heads"):
    """Noise on the weights of ``model.heads`` (or ``model.prefix``), away from their zero start."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in getattr(model, part).parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model



#: a small tree with side branches and depth 3 (the step-state tests' tree)
STEP_TREE = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (2,)]


def prefix_heads_model():
    """A tiny model whose heads read the next token, their tree path and the prefix (attention), every weight away
    from its start: the model whose decode state has the most parts."""
    from helpers.backbones import make_tiny_backbone
    from medusa_train import MedusaModel

    model = MedusaModel.from_backbone(make_tiny_backbone(), num_heads=3, next_token_input=True, path_input=True,
                                      prefix_attention=True).eval()
    return randomise(randomise(model), part="prefix")


def assert_steps_keep_decode_state(steps, context: int, calls) -> None:
    """Each of ``calls`` (run twice, in order) leaves ``steps``' state (a ``DecodeSteps`` or its benchmark
    breakdown, set up at ``context`` cached tokens) exactly as it found it: the backbone's KV cache and the heads'
    own prefix-attention cache, so each step can be timed alone, in any order."""
    def snapshot():
        layers = [(layer.keys.clone(), layer.values.clone()) for layer in steps.cache.layers]
        return layers, steps.heads_state.prefix_cache.keys.clone(), steps.heads_state.prefix_cache.values.clone()

    before = snapshot()
    for call in calls:
        for _ in range(2):
            call()
            assert steps.cache.get_seq_length() == context
            after = snapshot()
            for (k0, v0), (k1, v1) in zip(before[0], after[0]):
                assert torch.equal(k0, k1) and torch.equal(v0, v1)
            assert torch.equal(before[1], after[1]) and torch.equal(before[2], after[2])


def demo_like_heads(hidden: int = 64, device: str = "cpu"):
    """Heads of the demo's kind (prefix attention, path input, a shared LM head, a draft vocabulary of 87 tokens) on a
    tiny llama of width ``hidden``, every weight away from its zero start, as trained heads are."""
    from helpers.backbones import make_tiny_backbone
    from medusa_train import MedusaModel

    token_map = torch.tensor(sorted({1, 2, *range(3, 256, 3)}))
    model = MedusaModel.from_backbone(make_tiny_backbone("llama", seed=3, hidden_size=hidden), num_heads=4,
                                      share_lm_head=True, next_token_input=True, path_input=True,
                                      prefix_attention=True, token_map=token_map)
    return randomise(randomise(model, seed=1, scale=0.2), seed=2, scale=0.2, part="prefix").to(device)


def eagle3_like_draft(model_class=None, device: str = "cpu"):
    """An EAGLE-3 draft (or ``model_class``'s, e.g. P-EAGLE's) on a tiny four-layer llama whose LM head is scaled up
    (a peaked teacher, as a trained model's), its weights tripled for varied guesses, a draft vocabulary of the even
    tokens."""
    from helpers.backbones import make_tiny_backbone
    from medusa_train.families.eagle3.model import Eagle3Model

    backbone = make_tiny_backbone("llama", layers=4)
    with torch.no_grad():
        backbone.get_output_embeddings().weight.mul_(20)
    torch.manual_seed(0)
    model = (model_class or Eagle3Model).from_backbone(backbone, token_map=torch.arange(0, 256, 2),
                                                       aux_layer_ids=[0, 1, 3], ttt_steps=4).eval()
    with torch.no_grad():
        for p in model.draft.parameters():
            p.mul_(3.0)
    return model.to(device)
