"""``benchmarks/steps.py``: a verify step's parts, timed alone by ``python -m benchmarks decode``."""

import pytest
from helpers.heads import STEP_TREE, assert_steps_keep_decode_state, prefix_heads_model

from benchmarks.steps import DecodeStepParts
from medusa_train.decoding import TokenTree

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_part_of_a_step_leaves_the_decode_state_as_it_found_it():
    """The breakdown times each part from the same state, in any order: the backbone's cache and the heads'
    own (prefix attention) cache must come back exactly as they were."""
    context = 24
    steps = DecodeStepParts(prefix_heads_model(), context)
    tree = TokenTree(STEP_TREE)
    assert_steps_keep_decode_state(steps, context, (
        steps.candidates_step(tree), steps.forward_step(tree), steps.forward_step(TokenTree([])),
        steps.lm_head_step(tree.num_nodes), steps.verify_step(tree)))
