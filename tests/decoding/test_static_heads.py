"""The heads' decode state over fixed buffers (``families/medusa/decode_state.py``): what a graphed decoder replays.

With a static cache the heads keep their prefix layer's keys and values in rooms as long as the cache and the count
they hold on the device, so each step's passes read and write the same buffers (on CUDA replayed from graphs:
``tests/gpu/test_graphs.py``). On the CPU, eagerly, the candidates they propose at every step are the eager state's,
token for token, for the demo's kind of heads (prefix attention, path input, a shared LM head, a draft vocabulary),
whether the step attention takes the prefix layer's steps (heads of 32) or SDPA does (heads of 16).
"""

from __future__ import annotations

import pytest
import torch
from helpers.decoding import decode_recording_candidates as decode
from helpers.decoding import hf_greedy, repeating_prompts
from helpers.heads import demo_like_heads

from medusa_train.decoding import TokenTree
from medusa_train.decoding.graphs import StaticSteps
from medusa_train.families.medusa.decode_state import StaticHeadsState

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.mark.parametrize("hidden", [64, 128])
def test_heads_over_fixed_buffers_propose_what_eager_heads_propose(hidden):
    model = demo_like_heads(hidden)
    reads = []
    for ids in repeating_prompts():
        reference = hf_greedy(model.backbone, ids, 40, eos_token_id=[])
        for tree in (TokenTree.from_name("default"), TokenTree.from_name("small").with_lookup(5)):
            eager, eager_proposed = decode(model, ids, tree)
            static, static_proposed = decode(model, ids, tree, kv_cache="static")
            assert static_proposed == eager_proposed, (hidden, tree.num_nodes)
            assert static.sequences.tolist() == eager.sequences.tolist() == reference.tolist()
            assert static.accept_lengths == eager.accept_lengths
            reads += static.accept_lengths
    assert max(reads) >= 3  # reads of several accepted positions, not one a step


def test_one_static_state_serves_every_generation_of_a_static_cache():
    """``StaticSteps.draft_state``: the same state for every generation (emptied in place), a larger one once the
    cache grows, and each generation proposes what a fresh eager state does."""
    model = demo_like_heads(128)
    steps = StaticSteps(model, length_step=48)
    states, rooms = [], []
    tree = TokenTree.from_name("small").with_lookup(5)
    for ids in repeating_prompts():
        for new_tokens in (10, 40):
            eager, eager_proposed = decode(model, ids, tree, new_tokens)
            kept, kept_proposed = decode(model, ids, tree, new_tokens, steps=steps)
            assert kept_proposed == eager_proposed and kept.sequences.tolist() == eager.sequences.tolist()
            states.append(steps.draft), rooms.append(steps.draft.room)
    assert all(isinstance(s, StaticHeadsState) for s in states)
    assert len({id(s) for s in states}) == len(set(rooms)) >= 2  # one state per room: kept, replaced when it grew
    assert steps.draft.captures == 0  # no graphs on the CPU


def test_fixed_buffers_refuse_what_does_not_fit():
    model = demo_like_heads(64)
    state = model.new_decode_state(room=8)
    with torch.no_grad():
        state.read(model, torch.randn(6, 64))
        with pytest.raises(ValueError, match="hold 8 positions; 6 read and 3 more do not fit"):
            state.read(model, torch.randn(3, 64))
    with pytest.raises(ValueError, match="graphed heads need a CUDA model"):
        model.new_decode_state(room=8, graphs=True)
    with pytest.raises(ValueError, match="give the room they read into"):
        model.new_decode_state(graphs=True)
