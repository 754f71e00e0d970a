"""``benchmarks/steps.py``: a verify step's parts, timed alone by ``python -m benchmarks decode``."""

import pytest
import torch
from helpers.backbones import make_tiny_backbone
from helpers.heads import randomise

from benchmarks.steps import DecodeStepParts
from medusa_train import MedusaModel
from medusa_train.decoding import MedusaTree

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_part_of_a_step_leaves_the_decode_state_as_it_found_it():
    """The breakdown times each part from the same state, in any order: the backbone's cache and the heads'
    own (prefix attention) cache must come back exactly as they were."""
    model = MedusaModel.from_backbone(make_tiny_backbone(), num_heads=3, next_token_input=True, path_input=True,
                                      prefix_attention=True).eval()
    randomise(randomise(model), part="prefix")  # both the heads and the prefix layer away from their start
    context = 24
    steps = DecodeStepParts(model, context)
    tree = MedusaTree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (2,)])

    def snapshot():
        layers = [(layer.keys.clone(), layer.values.clone()) for layer in steps.cache.layers]
        return layers, steps.heads_state.prefix_cache.keys.clone(), steps.heads_state.prefix_cache.values.clone()

    before = snapshot()
    for step in (steps.candidates_step(tree), steps.forward_step(tree), steps.forward_step(MedusaTree([])),
                 steps.lm_head_step(tree.num_nodes), steps.verify_step(tree)):
        for _ in range(2):
            step()
            assert steps.cache.get_seq_length() == context
            after = snapshot()
            for (k0, v0), (k1, v1) in zip(before[0], after[0]):
                assert torch.equal(k0, k1) and torch.equal(v0, v1)
            assert torch.equal(before[1], after[1]) and torch.equal(before[2], after[2])
