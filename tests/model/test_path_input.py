"""Heads that read their whole tree path (``heads.path_input``): head k reads the k + 1 tokens between
its position and its target. The formula, the zero start, the round trip and refusals, and that
candidates are read from each node's parent path. Decoding and calibration with oracle path heads
are the ``path_input=True`` cases in tests/model/test_next_token_input.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.heads import randomise

from medusa_train import MedusaModel
from medusa_train.config.check import ConfigError
from medusa_train.config.train import build_config
from medusa_train.decoding import TokenTree
from medusa_train.families.medusa.export import export_heads
from medusa_train.families.medusa.layouts import MedusaConfig
from medusa_train.families.medusa.model import path_tokens
from medusa_train.families.medusa.propose import heads_candidates

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def path_model(backbone, num_heads=3, **kwargs) -> MedusaModel:
    return MedusaModel.from_backbone(backbone, num_heads=num_heads, next_token_input=True, path_input=True, **kwargs)


def test_path_tokens_shift_the_sequence():
    tokens = torch.tensor([[5, 6, 7, 8]])
    assert path_tokens(tokens, 3).tolist() == [[[5, 6, 7], [6, 7, 8], [7, 8, 0], [8, 0, 0]]]


@pytest.mark.parametrize("share_lm_head", [False, True])
def test_head_k_adds_the_embeddings_of_the_k_plus_1_tokens_of_its_path(tiny_llama, share_lm_head):
    model = randomise(path_model(tiny_llama, share_lm_head=share_lm_head))
    hidden_size = tiny_llama.get_input_embeddings().weight.shape[1]
    ids = torch.randint(0, 256, (1, 7))
    paths = torch.randint(0, 256, (1, 7, 3))
    embedding = tiny_llama.get_input_embeddings().weight
    with torch.no_grad():
        hidden = model(ids).hidden_states
        inputs = model.head_features(hidden, paths)
        for k in range(3):
            first = model.heads[k].blocks[0]
            assert first.token.weight.shape == (hidden_size, (k + 1) * hidden_size)
            e = embedding[paths[..., : k + 1]].flatten(-2)
            x = hidden + F.silu(hidden @ first.linear.weight.T + first.linear.bias + e @ first.token.weight.T)
            out_layer = tiny_llama.get_output_embeddings().weight if share_lm_head else model.heads[k].lm_head.weight
            torch.testing.assert_close(model.head_logits(inputs, k), x @ out_layer.T)
            # tokens past the head's own path do not move it; the last token of its path does
            later = paths.clone()
            later[..., k + 1:] = (later[..., k + 1:] + 1) % 256
            assert torch.equal(model.head_logits(model.head_features(hidden, later), k), model.head_logits(inputs, k))
            own = paths.clone()
            own[..., k] = (own[..., k] + 1) % 256
            assert not torch.equal(model.head_logits(model.head_features(hidden, own), k), model.head_logits(inputs, k))
        # one token per position reads the sequence's own next tokens as the path
        tokens = torch.randint(0, 256, (1, 7))
        assert torch.equal(model.head_features(hidden, tokens), model.head_features(hidden, path_tokens(tokens, 3)))
        # a head asked with a path shorter than its own is an error, not a silent misread
        with pytest.raises(ValueError, match="token embedding"):
            model.head_logits(model.head_features(hidden, paths[..., :1]), 1)


def test_fresh_path_heads_reproduce_the_lm_head(tiny_llama):
    model = path_model(tiny_llama, share_lm_head=True)
    with torch.no_grad():
        out = model(torch.randint(0, 256, (1, 6)), return_base_logits=True)
        inputs = model.head_features(out.hidden_states, torch.randint(0, 256, (1, 6, 3)))
        for k in range(3):
            assert torch.equal(model.head_logits(inputs, k), out.base_logits)


def test_round_trip_refusals_and_config_errors(tiny_llama, tmp_path):
    model = randomise(path_model(tiny_llama))
    model.save_pretrained(tmp_path / "native")
    loaded = MedusaModel.from_pretrained(tmp_path / "native", backbone=tiny_llama)
    assert loaded.config.path_input
    with torch.no_grad():
        hidden = model(torch.randint(0, 256, (1, 6))).hidden_states
        inputs = model.head_features(hidden, torch.randint(0, 256, (1, 6, 3)))
        for k in range(3):
            assert torch.equal(loaded.head_logits(inputs, k), model.head_logits(inputs, k))
    for layout in ("medusa_v1", "vllm"):
        with pytest.raises(ValueError, match="next_token_input"):
            export_heads(model, tmp_path / layout, layout)
        assert not (tmp_path / layout).exists()
    with pytest.raises(ValueError, match="next_token_input=true"):
        MedusaConfig(num_heads=2, num_layers=1, hidden_size=8, vocab_size=16, path_input=True)
    with pytest.raises(ConfigError, match="heads.path_input"):
        build_config({"heads": {"path_input": True}})


def test_candidates_are_read_from_each_nodes_parent_path(tiny_llama):
    model = randomise(path_model(tiny_llama))
    with torch.no_grad():  # the tiny model's embeddings are small (std 0.02): let the path decide the guesses
        for head in model.heads:
            head.blocks[0].token.weight.mul_(100)
    tree = TokenTree.from_name("default").truncated(max_depth=3)
    with torch.no_grad():
        prompt = model(torch.randint(0, 256, (1, 6))).hidden_states[0]
        hidden = prompt[-1:]
        tokens = heads_candidates(model, tree, prompt, 17, model.new_decode_state())
        assert tokens[0] == 17
        for node in range(1, tree.num_nodes):
            depth, rank = int(tree.node_heads[node]), int(tree.node_ranks[node])
            parent_path = tokens[tree.ancestors[int(tree.parents[node]), : depth + 1]]
            assert parent_path[0] == 17 and len(parent_path) == depth + 1
            logits = model.head_logits(model.head_features(hidden, parent_path[None]), depth)
            assert tokens[node] == logits[0].topk(rank + 1).indices[rank]
    # the same rank under different parents gives different guesses: head 2 reads the path, not the root alone
    paths = tree.node_paths()
    pairs = [(paths.index((0, r)), paths.index((1, r))) for r in range(3) if (0, r) in paths and (1, r) in paths]
    assert pairs and any(tokens[a] != tokens[b] for a, b in pairs)


def test_tree_levels_and_ancestors():
    tree = TokenTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    # nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]
    assert tree.ancestors.tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [0, 2, -1, -1], [0, 1, 3, -1],
                                       [0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    levels = [[t.tolist() for t in level] for level in tree.levels]
    assert levels == [[[0], [1, 2], [0, 0], [0, 1]],
                      [[1, 2], [3, 4, 5], [0, 0, 1], [0, 1, 0]],
                      [[3], [6], [0], [0]]]
