"""The drafts' decode states over fixed buffers (``families/*/decode_state.py``): what a graphed decoder replays.

With a static cache a draft keeps its own keys and values in rooms as long as the cache and the count they hold on
the device, so each step's passes read and write the same buffers (on CUDA replayed from graphs:
``tests/gpu/test_graphs.py``). On the CPU, eagerly, the candidates they propose at every step are the eager state's,
token for token: Medusa heads of the demo's kind (prefix attention, path input, a shared LM head, a draft vocabulary),
whether the step attention takes the prefix layer's steps (heads of 32) or SDPA does (heads of 16), and an EAGLE-3
draft (its tree's drafted nodes written after the verified positions); a P-EAGLE draft keeps its eager state.
"""

from __future__ import annotations

import pytest
import torch
from helpers.decoding import decode_recording_candidates as decode
from helpers.decoding import hf_greedy, repeating_prompts
from helpers.heads import demo_like_heads, eagle3_like_draft
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import StaticCache

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


def test_an_eagle3_draft_over_fixed_buffers_proposes_what_the_eager_draft_proposes():
    from medusa_train.families.eagle3.decode_state import Eagle3DecodeState, Eagle3StaticState
    from medusa_train.families.peagle.model import PEagleModel

    model = eagle3_like_draft()
    reads = []
    trees = (TokenTree.from_name("default"), TokenTree.chain(3), TokenTree.from_name("small").with_lookup(5))
    for ids in repeating_prompts():
        reference = hf_greedy(model.backbone, ids, 40, eos_token_id=[])
        for tree in trees:
            eager, eager_proposed = decode(model, ids, tree)
            static, static_proposed = decode(model, ids, tree, kv_cache="static")
            assert static_proposed == eager_proposed, tree.num_nodes
            assert static.sequences.tolist() == eager.sequences.tolist() == reference.tolist()
            reads += static.accept_lengths
    assert max(reads) >= 3 and isinstance(model.new_decode_state(room=64), Eagle3StaticState)
    peagle = eagle3_like_draft(PEagleModel)  # its one masked pass: the eager state, whatever the cache
    assert isinstance(peagle.new_decode_state(room=64), Eagle3DecodeState)
    ids = repeating_prompts()[1]
    assert decode(peagle, ids, trees[0], kv_cache="static")[1] == decode(peagle, ids, trees[0])[1]


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
        with pytest.raises(ValueError, match="the rooms of the heads keep 8 positions; 6 read, 3 more and 0 drafted do not fit"):
            state.read(model, torch.randn(3, 64))
    with pytest.raises(ValueError, match="graphed passes of the heads need a CUDA model"):
        model.new_decode_state(room=8, graphs=True)
    with pytest.raises(ValueError, match="give the room they read into"):
        model.new_decode_state(graphs=True)


class HostWaits(TorchDispatchMode):
    """Records every operator call that on a GPU waits for the device (a value read back, a data-dependent shape) or
    copies a tensor made from host values: what a CUDA graph's capture refuses. Runs on the CPU."""

    WAITS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal", "allclose", "lift_fresh",
             "lift_fresh_copy", "masked_scatter"}

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        indices = args[1] if name.startswith("index") and len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
        if name in self.WAITS or any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices):
            self.found.append(name)  # a boolean mask as an index: its shape is its count of True
        return func(*args, **(kwargs or {}))


def test_what_a_graph_replays_never_waits_for_the_device():
    """The passes captured on CUDA (the heads' read and guesses, an EAGLE-3 draft's read and tree, the backbone's pass
    over a static cache, ``move_slots``) run here under a spy: no value read
    back, no shape that depends on data, no tensor made from host values, each of which a capture refuses. The spy
    catches them: reading a length back (``int``) is found."""
    from medusa_train.decoding.graphs import move_slots
    from medusa_train.decoding.tree import fill_step_mask
    from medusa_train.families.medusa.propose import heads_guesses

    model = demo_like_heads(128)
    state = model.new_decode_state(room=64)
    hidden = torch.randn(12, 128, generator=torch.Generator().manual_seed(0))
    tree = TokenTree.from_name("small")
    cache = StaticCache(config=model.backbone.config, max_cache_len=32)
    with torch.no_grad():
        state.read(model, hidden[:9])  # the prompt: read eagerly, as a prefill is
        model(torch.arange(3, 12)[None], past_key_values=cache, use_cache=True)
        root, source, target, length = torch.tensor(7), torch.tensor([9, 11, 10]), torch.tensor([9, 10, 11]), torch.tensor(11)
        mask = fill_step_mask(torch.empty(tree.num_nodes, 32), tree.attention_mask(), 9)[None, None]
        tokens, positions = torch.randint(3, 200, (1, tree.num_nodes)), (9 + tree.position_offsets)[None]
        with HostWaits() as spy:
            state._read(hidden[9:])
            heads_guesses(model, tree, root, state)
            model(tokens, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
            move_slots(cache, source, target, length)
        assert spy.found == []
        with HostWaits() as spy:
            int(state.length)
        assert spy.found == ["_local_scalar_dense"]
    draft = eagle3_like_draft()  # an EAGLE-3 draft's read and tree
    state, ids = draft.new_decode_state(room=64), torch.arange(3, 15)[None]
    with torch.no_grad():
        out = draft(ids)
        state.propose(draft, tree, out.draft_inputs[0, :9], ids[0, :9], 7)  # the prompt, eagerly; the tree planned
        inputs, tokens = out.draft_inputs[0, 9:], ids[0, 9:]
        with HostWaits() as spy:
            state._read(inputs, tokens)
            state._draft(tree)
        assert spy.found == []
