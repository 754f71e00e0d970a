"""Heads that also read the next token (``heads.next_token_input``): the formula, the zero start, the
round trip, the layouts that cannot hold them, and that decoding, calibration and the loss feed them
the token the base model chose."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.backbones import make_tiny_backbone
from helpers.heads import randomise

from medusa_train import MedusaModel
from medusa_train.config.check import ConfigError
from medusa_train.config.train import build_config
from medusa_train.data.tokenize import IGNORE_INDEX
from medusa_train.decoding import TokenTree, tree_generate
from medusa_train.families.medusa.export import export_heads
from medusa_train.families.medusa.heads import MedusaHead
from medusa_train.families.medusa.propose import heads_candidates
from medusa_train.training.losses import depthwise_loss_backward, depthwise_loss_naive
from medusa_train.training.targets import (
    following_tokens,
    text_targets,
)
from medusa_train.tree.calibrate import measure_rank_accuracies

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def greedy_sequence(backbone, ids: torch.Tensor, n: int) -> torch.Tensor:
    return backbone.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             eos_token_id=10**6, pad_token_id=0)  # an id no model emits: exactly n tokens


@pytest.mark.parametrize("share_lm_head", [False, True])
def test_fresh_heads_reproduce_the_lm_head_whatever_the_token(tiny_backbone, share_lm_head):
    model = MedusaModel.from_backbone(tiny_backbone, num_heads=3, share_lm_head=share_lm_head, next_token_input=True)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        out = model(ids, return_base_logits=True)
        for tokens in (None, torch.randint(0, 256, (2, 9))):
            inputs = model.head_features(out.hidden_states, tokens)
            for k in range(3):
                assert torch.equal(model.head_logits(inputs, k), out.base_logits)


@pytest.mark.parametrize("share_lm_head", [False, True])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_a_head_adds_the_next_tokens_embedding_inside_its_first_block(tiny_llama, share_lm_head, num_layers):
    model = randomise(MedusaModel.from_backbone(tiny_llama, num_heads=2, num_layers=num_layers,
                                                share_lm_head=share_lm_head, next_token_input=True))
    ids = torch.randint(0, 256, (1, 7))
    tokens = torch.randint(0, 256, (1, 7))
    embedding = tiny_llama.get_input_embeddings().weight
    with torch.no_grad():
        hidden = model(ids).hidden_states
        for k in range(2):
            head = model.heads[k]
            first = head.blocks[0]
            x = hidden + F.silu(hidden @ first.linear.weight.T + first.linear.bias + embedding[tokens] @ first.token.weight.T)
            for block in head.blocks[1:]:
                assert block.token is None  # only the first block reads the token
                x = x + F.silu(x @ block.linear.weight.T + block.linear.bias)
            out_layer = tiny_llama.get_output_embeddings().weight if share_lm_head else head.lm_head.weight
            torch.testing.assert_close(model.head_logits(model.head_features(hidden, tokens), k), x @ out_layer.T)
        # the default next token is the base model's greedy choice, and the token changes the guess
        greedy = model.base_logits(hidden).argmax(-1)
        assert torch.equal(model.head_features(hidden), model.head_features(hidden, greedy))
        assert not torch.equal(model.head_logits(model.head_features(hidden, greedy), 0),
                               model.head_logits(model.head_features(hidden, (greedy + 1) % 256), 0))


@pytest.mark.parametrize("share_lm_head", [False, True])
def test_all_head_logits_equals_each_head_alone(tiny_llama, share_lm_head):
    model = randomise(MedusaModel.from_backbone(tiny_llama, num_heads=3, share_lm_head=share_lm_head,
                                                next_token_input=True))
    with torch.no_grad():
        inputs = model.head_features(model(torch.randint(0, 256, (1, 5))).hidden_states)
        stacked = model.all_head_logits(inputs)
        for k in range(3):
            torch.testing.assert_close(stacked[k], model.head_logits(inputs, k))


def test_round_trip_and_layouts_that_cannot_hold_them(tmp_path, tiny_llama):
    model = randomise(MedusaModel.from_backbone(tiny_llama, num_heads=2, next_token_input=True))
    model.save_pretrained(tmp_path / "native")
    loaded = MedusaModel.from_pretrained(tmp_path / "native", backbone=tiny_llama)
    assert loaded.config.next_token_input
    with torch.no_grad():
        inputs = model.head_features(model(torch.randint(0, 256, (1, 6))).hidden_states)
        for k in range(2):
            assert torch.equal(loaded.head_logits(inputs, k), model.head_logits(inputs, k))
    for layout in ("medusa_v1", "vllm"):
        with pytest.raises(ValueError, match="next_token_input"):
            export_heads(model, tmp_path / layout, layout)
        assert not (tmp_path / layout).exists()  # refused before anything is written
    with pytest.raises(ValueError, match="num_layers >= 1"):
        MedusaHead(64, 256, num_layers=0, token_inputs=1)


def test_config_names_the_key():
    with pytest.raises(ConfigError, match="heads.next_token_input"):
        build_config({"heads": {"next_token_input": True, "num_layers": 0}})


def install_token_oracle(model: MedusaModel, reference: torch.Tensor, ranks=(0, 0, 1, 0, 2, 0)) -> None:
    """Heads that know ``reference`` (1, L) but only when told what they read: head k given the hidden
    state of position j (as the heads read it: through the prefix attention layer if there is one) *and* the embedding of ``reference[j + 1]`` (with ``path_input``: of
    ``reference[j + 1 .. j + k + 1]``, its whole path) puts the token k + 2 ahead at a rank from
    ``ranks``; told anything else (or off the reference) its guesses are a fixed shuffle."""
    with torch.no_grad():
        hidden = model(reference).hidden_states
        size = hidden.shape[-1]  # what the heads read at each position, without the token part
        ref_hidden = model.head_features(hidden, torch.zeros_like(reference))[0, :, :size]
    tokens = reference[0].tolist()
    embedding = model.backbone.get_input_embeddings().weight
    size, vocab = embedding.shape[1], embedding.shape[0]

    def head_logits(inputs: torch.Tensor, k: int) -> torch.Tensor:
        flat = inputs.reshape(-1, inputs.shape[-1])
        dist, pos = torch.cdist(flat[:, :size], ref_hidden, compute_mode="donot_use_mm_for_euclid_dist").min(-1)
        rows = []
        for h_dist, j, row in zip(dist.tolist(), pos.tolist(), flat):
            order = torch.randperm(vocab, generator=torch.Generator().manual_seed(1000 * j + k)).tolist()
            told = j + k + 2 < len(tokens) and all(
                torch.equal(row[size * (i + 1): size * (i + 2)], embedding[tokens[j + 1 + i]])
                for i in range(model.config.token_inputs(k)))
            if h_dist < 1e-2 and told:
                order.remove(tokens[j + k + 2])
                order.insert(ranks[(j + 3 * k) % len(ranks)], tokens[j + k + 2])
            logits = torch.empty(vocab)
            logits[order] = torch.arange(vocab, 0, -1, dtype=torch.float)
            rows.append(logits)
        return torch.stack(rows).reshape(*inputs.shape[:-1], vocab)

    model.head_logits = head_logits


def oracle_model(backbone, num_heads: int, reads: str) -> MedusaModel:
    """Heads reading the next token, their path, or their path through a (random) prefix attention layer."""
    model = MedusaModel.from_backbone(backbone, num_heads=num_heads, next_token_input=True,
                                      path_input=reads != "next", prefix_attention=reads == "prefix")
    return randomise(model, seed=7, scale=0.2, part="prefix") if model.prefix is not None else model


@pytest.mark.parametrize("reads", ["next", "path", "prefix"])
def test_decoding_tells_the_heads_the_tokens_they_read(reads):
    """Oracle heads that are right only when given the tokens they read (the tree's root; for path
    heads the root and every guess on their path) and the hidden state they read (through the
    prefix attention layer, fed every accepted position in order): decoding must accept long paths,
    reaching depth 4 (it could not if it fed them anything else, e.g. only the root to a deeper path
    head, or a prefix cache missing a token), and stay identical to greedy."""
    backbone = make_tiny_backbone("llama", seed=4)
    model = oracle_model(backbone, 4, reads)
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    reference = greedy_sequence(backbone, ids, 40)
    install_token_oracle(model, reference)
    out = tree_generate(model, ids, TokenTree.from_name("default"), max_new_tokens=40, eos_token_id=[])
    assert out.sequences.tolist() == reference.tolist()
    assert max(out.accepted_depths) == 4 and out.mean_accept_length > 2.5


@pytest.mark.parametrize("reads", ["next", "path", "prefix"])
def test_calibration_tells_the_heads_the_continuations_tokens(reads):
    """Calibration gives each head the greedy continuation's own tokens (next token, or whole path)
    and hidden states (through the prefix attention layer): oracle heads then measure exactly 1.0
    at rank 0."""
    backbone = make_tiny_backbone("llama", seed=4)
    model = oracle_model(backbone, 3, reads)
    ids = torch.randint(3, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    reference = greedy_sequence(backbone, ids, 20)
    install_token_oracle(model, reference, ranks=(0,))
    accuracies, counts = measure_rank_accuracies(model, [(reference, ids.shape[1])], top_k=3)
    assert accuracies == [[1.0, 0.0, 0.0]] * 3
    assert counts == [20 - k - 1 for k in range(3)]


def test_loss_gradients_reach_the_hidden_states_through_the_heads_inputs(tiny_llama):
    """Medusa-2 trains the backbone through the heads' inputs: head-by-head equals the naive loss."""
    model = randomise(MedusaModel.from_backbone(tiny_llama, num_heads=3, next_token_input=True))
    ids = torch.randint(0, 256, (2, 12))
    labels = ids.clone()
    labels[0, :3] = -100
    with torch.no_grad():
        base_hidden = model(ids).hidden_states
    grads = []
    for naive in (True, False):
        hidden = base_hidden.clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        if naive:
            loss, _ = depthwise_loss_naive(model.head_logits, model.head_features(hidden), text_targets(labels, 3))
            loss.backward()
        else:
            depthwise_loss_backward(model.head_logits, model.head_features(hidden), text_targets(labels, 3), chunk_size=5)
        grads.append([hidden.grad.clone(), *(p.grad.clone() for p in model.heads.parameters())])
    assert grads[0][0].abs().sum() > 0 and grads[0][-1].abs().sum() > 0
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_candidates_come_from_the_root_they_are_given(tiny_llama):
    """The heads read the root passed in (with sampling it need not be the greedy token)."""
    model = randomise(MedusaModel.from_backbone(tiny_llama, num_heads=3, next_token_input=True))
    tree = TokenTree.from_name("default").truncated(max_depth=3)
    with torch.no_grad():
        prompt = model(torch.randint(0, 256, (1, 6))).hidden_states[0]
        hidden = prompt[-1:]
        greedy = int(model.base_logits(hidden).argmax())
        other = (greedy + 7) % 256
        tokens = heads_candidates(model, tree, prompt, other, model.new_decode_state())
        logits = model.all_head_logits(model.head_features(hidden, torch.tensor([other])), 3)
    assert tokens[0] == other
    for node in range(1, tree.num_nodes):
        head, rank = int(tree.node_heads[node]), int(tree.node_ranks[node])
        assert tokens[node] == logits[head, 0].topk(rank + 1).indices[rank]
    with torch.no_grad():  # another root, other guesses
        assert not torch.equal(tokens[1:], heads_candidates(model, tree, prompt, greedy, model.new_decode_state())[1:])


def test_training_gives_heads_the_texts_next_token_else_the_greedy_one():
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 11, 12, 13, IGNORE_INDEX, IGNORE_INDEX]])
    predictions = torch.tensor([[21, 22, 23, 24, 25, 26, 27]])
    asked = []

    def greedy(mask):
        asked.append(mask.clone())
        return predictions[mask]

    # position t reads labels[t + 1] (the text the targets continue) where it is trained text; the greedy
    # choice only where a head has a target but there is no text (t = 0, before the reply), nowhere else
    tokens = following_tokens(labels, 2, greedy)
    assert tokens[0, :4].tolist() == [21, 11, 12, 13]
    assert [m[0].nonzero().flatten().tolist() for m in asked] == [[0]]
    assert following_tokens(torch.full_like(labels, IGNORE_INDEX), 2, greedy).tolist() == [[0] * 7]
    assert len(asked) == 1  # no target anywhere: the LM head is not asked at all
