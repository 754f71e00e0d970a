"""The EAGLE-3 draft: what it proposes is what training-time test scores, a tree's rank-0 path is the chain, its
folder is vLLM's layout and round-trips bit-exact, and greedy decoding with it is the backbone's own (float32).

A draft at random weights never guesses right, so parity is also checked with drafts fitted for a few hundred steps
to the backbone's own greedy text (``fitted_draft``): then long accepted paths, and the draft's cache across them,
are exercised."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.backbones import make_tiny_backbone
from safetensors.torch import load_file

from medusa_train.decoding import TokenTree, tree_generate
from medusa_train.families.eagle3.config import Eagle3Config, default_aux_layers, is_eagle3_config
from medusa_train.families.eagle3.loss import ttt_loss
from medusa_train.families.eagle3.model import Eagle3Model, chained_attention
from medusa_train.model.family import FAMILIES, family_of

pytestmark = pytest.mark.usefixtures("one_thread")

AUX = [0, 1, 3]
VOCAB_MAP = torch.arange(0, 256, 2)  # a draft vocabulary of the even tokens


def backbone(arch: str = "llama"):
    """Four layers (the draft reads three); the LM head scaled up so its distribution is as peaked as a trained
    model's (greedy choices unchanged), else a random model's near-uniform teacher teaches no top token."""
    model = make_tiny_backbone(arch, layers=4)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)
    return model


def draft_for(bb, token_map=VOCAB_MAP, seed: int = 0, scale: float = 3.0) -> Eagle3Model:
    torch.manual_seed(seed)
    model = Eagle3Model.from_backbone(bb, token_map=token_map, aux_layer_ids=AUX, ttt_steps=4).eval()
    with torch.no_grad():  # larger weights than the init: varied guesses
        for p in model.draft.parameters():
            p.mul_(scale)
    return model


def greedy(bb, ids: torch.Tensor, n: int) -> torch.Tensor:
    return bb.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                       eos_token_id=[], pad_token_id=0)


def fitted_draft(bb, steps: int = 150, seed: int = 0) -> tuple[Eagle3Model, list[torch.Tensor]]:
    """A draft (whole vocabulary) trained with training-time test on the backbone's greedy continuations of a few
    prompts; returns it and the prompts."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 256, (1, 6), generator=g) for _ in range(4)]
    texts = torch.cat([greedy(bb, p, 40) for p in prompts])
    model = Eagle3Model.from_backbone(bb, aux_layer_ids=AUX, ttt_steps=4)
    optimizer = torch.optim.AdamW(model.draft.parameters(), lr=1e-2)
    with torch.no_grad():
        out = model(texts)
    labels, mask = texts.clone(), torch.ones_like(texts)
    for _ in range(steps):
        ttt_loss(model, out.draft_inputs, out.hidden_states, texts, mask, labels, 4, 0.8, backward=torch.Tensor.backward)
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), prompts


def test_the_chain_proposes_what_training_time_test_scores():
    """Decoding feeds step s the token and pre-norm feature training-time test feeds it: the chain's guess at each
    depth is the argmax of training's step at the same row, with the chain's own tokens as the text."""
    bb = backbone()
    model = draft_for(bb)
    tree = TokenTree.chain(4)
    text = torch.randint(3, 256, (1, 14), generator=torch.Generator().manual_seed(1))
    for p in (2, 6, 11):
        with torch.no_grad():
            proposed = model.propose(tree, model(text[:, :p + 1]).draft_inputs[0], text[0, :p + 1], int(text[0, p + 1]),
                                     model.new_decode_state())
            chained = torch.cat([text[0, :p + 1], proposed])[None]  # the root, then the guesses, as the text
            scored = _training_argmax(model, chained, p, steps=4)
        assert proposed[1:].tolist() == scored


def _training_argmax(model: Eagle3Model, text: torch.Tensor, row: int, steps: int) -> list[int]:
    draft, seq = model.draft, text.shape[1]
    feature, keys, values, best = draft.features(model(text).draft_inputs), [], [], []
    for s in range(steps):
        tokens = torch.nn.functional.pad(text[:, s + 1:], (0, s + 1))
        q, k, v, residual = draft.qkv(model.backbone.get_input_embeddings()(tokens), feature,
                                      (torch.arange(seq) + s)[None])
        keys.append(k)
        values.append(v)
        normed, feature = draft.finish(chained_attention(draft, q, keys, values, torch.ones_like(text)), residual)
        best.append(int(model.guessed_tokens(draft.logits(normed[0, row]).argmax())))
    return best


def test_a_trees_rank_zero_path_is_the_chain_and_siblings_never_see_each_other():
    bb = backbone("qwen2")
    model = draft_for(bb, seed=3)
    tree = TokenTree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]])
    chain = TokenTree.chain(4)
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        inputs = model(ids).draft_inputs[0]
        in_tree = model.propose(tree, inputs, ids[0], 7, model.new_decode_state())
        in_chain = model.propose(chain, inputs, ids[0], 7, model.new_decode_state())
        # the side branch root -> [0] -> [0, 1] -> [0, 1, 0] alone: what it drafts must not depend on its siblings
        branch = TokenTree([[0], [0, 1], [0, 1, 0]])
        alone = model.propose(branch, inputs, ids[0], 7, model.new_decode_state())
    index = {path: i + 1 for i, path in enumerate(tree.choices)}
    assert [int(in_tree[index[(0,) * d]]) for d in range(1, 5)] == in_chain[1:].tolist()
    alone_index = {path: i + 1 for i, path in enumerate(branch.choices)}
    assert [int(in_tree[index[p]]) for p in branch.choices] == [int(alone[alone_index[p]]) for p in branch.choices]
    assert len({int(in_tree[index[(r,)]]) for r in range(3)}) == 3  # top-3 are three tokens
    assert all(int(t) % 2 == 0 for t in in_tree[1:])  # guesses come from the draft vocabulary (even tokens)


def test_the_drafts_cache_is_written_in_place_and_a_tree_leaves_only_the_verified_positions():
    """Each step writes its verified positions after those the cache holds, in its room (moved only when outgrown, as
    ``AppendingLayer`` doubles), and the tree's drafted nodes after them for the step alone: afterwards the cache holds
    exactly the verified positions, the earlier ones bitwise as they were, and the proposal equals that of a state that
    never drafted a tree (a chain of depth 0 at every step before)."""
    bb = backbone()
    model = draft_for(bb, seed=4)
    tree = TokenTree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]])
    root_only = TokenTree([])
    ids = torch.randint(3, 256, (1, 41), generator=torch.Generator().manual_seed(5))
    chunks = [16, 1, 2, 1, 3, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1]
    drafted, plain = model.new_decode_state(), model.new_decode_state()
    rooms, start = set(), 0
    with torch.no_grad():
        inputs = model(ids).draft_inputs[0]
        for n in chunks:
            held = drafted.cache.keys.clone() if start else None
            root = int(ids[0, start + n])
            got = model.propose(tree, inputs[start:start + n], ids[0, start:start + n], root, drafted)
            model.propose(root_only, inputs[start:start + n], ids[0, start:start + n], root, plain)
            start += n
            assert drafted.length == plain.length == start  # the drafted nodes' slots dropped
            assert torch.equal(drafted.cache.keys, plain.cache.keys) and torch.equal(drafted.cache.values,
                                                                                   plain.cache.values)
            if held is not None:
                assert torch.equal(drafted.cache.keys[..., :held.shape[-2], :], held)
            rooms.add(drafted.cache.key_room.data_ptr())
            assert got[0] == root and len(got) == tree.num_nodes
    # 16 positions, then 24 more with up to 8 drafted nodes after them: rooms of 16, 32, 64 (each move a doubling)
    assert len(rooms) <= 3


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_with_a_fitted_draft_is_token_identical_to_plain_greedy(arch):
    bb = backbone(arch)
    model, prompts = fitted_draft(bb)
    trees = [TokenTree.chain(4), TokenTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]),
             TokenTree([[0], [1], [0, 0], [0, 0, 0]], lookup_depth=4)]  # the draft beside a lookup chain
    for tree in trees:
        gained = steps = looked_up = 0
        for ids in prompts + [torch.randint(3, 256, (1, 5), generator=torch.Generator().manual_seed(9))]:
            out = tree_generate(model, ids, tree=tree, max_new_tokens=40, eos_token_id=[])
            assert torch.equal(out.sequences, greedy(bb, ids, 40))
            gained, steps, looked_up = gained + out.new_tokens, steps + out.steps, looked_up + sum(out.lookup_depths)
        assert gained / steps > 2.0, (tree.num_nodes, gained / steps)  # long accepted paths were exercised
        # after steps that kept the chain the draft reads what was accepted, and keeps drafting as well
        assert looked_up > 0 or not tree.lookup_depth


def test_the_folder_is_vllms_layout_and_round_trips_bit_exact(tmp_path):
    bb = backbone()
    model = draft_for(bb)
    folder = model.save_pretrained(tmp_path / "draft", chat_template="{{ messages }}")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 128 and config["vocab_size"] == 256
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    assert config["rope_parameters"] == dict(bb.config.rope_parameters) and not config["tie_word_embeddings"]
    assert family_of(config) == (FAMILIES["eagle3"], "vllm") and is_eagle3_config(config)
    assert not {"norm_before_residual", "norm_output", "fc_norm", "norm_before_fc"} & set(config)
    tensors = load_file(str(folder / "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t"} <= set(tensors) and not any(k.startswith("model.") for k in tensors)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (4 * 16, 2 * 64)
    assert tensors["fc.weight"].shape == (64, 3 * 64) and tensors["lm_head.weight"].shape == (128, 64)
    assert torch.equal(tensors["d2t"] + torch.arange(128), VOCAB_MAP)  # target id = draft id + d2t[draft id]
    loaded = Eagle3Model.from_pretrained(folder, backbone=bb)
    for (name, a), (_, b) in zip(model.draft.state_dict().items(), loaded.draft.state_dict().items()):
        assert torch.equal(a, b), name
    whole = draft_for(bb, token_map=None).save_pretrained(tmp_path / "whole")
    assert "d2t" not in load_file(str(whole / "model.safetensors"))  # the whole vocabulary needs no map


def test_a_missing_tensor_or_another_backbone_is_refused(tmp_path):
    from safetensors.torch import save_file

    bb = backbone()
    folder = draft_for(bb).save_pretrained(tmp_path / "draft")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["norm.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors: norm.weight"):
        Eagle3Model.from_pretrained(folder, backbone=bb)
    with pytest.raises(ValueError, match="does not fit this backbone"):
        Eagle3Model(make_tiny_backbone("llama", layers=4, hidden_size=32), draft_for(bb).config)


def test_default_layers_are_vllms_and_shallow_backbones_must_name_theirs():
    assert default_aux_layers(30) == [2, 15, 27]  # SmolLM2-135M: what vLLM reads by default
    assert default_aux_layers(32) == [2, 16, 29]
    with pytest.raises(ValueError, match="eagle3.aux_layer_ids"):
        default_aux_layers(4)
    with pytest.raises(ValueError, match="three distinct layers, ascending"):
        Eagle3Config.for_backbone(backbone(), aux_layer_ids=[1, 1, 2])


def test_calibration_measures_the_draft_along_its_own_path():
    """``build-tree``'s rank accuracies for a draft: depth k is its k-th chained step given the text before it; a
    draft fitted to the text scores it far above a random one, every depth counts the positions it can guess, and
    the ranks of one depth never sum past 1."""
    from medusa_train.tree.calibrate import measure_rank_accuracies

    bb = backbone()
    fitted, prompts = fitted_draft(bb)
    sequences = [(greedy(bb, p, 40), p.shape[1]) for p in prompts]
    accuracies, counts = measure_rank_accuracies(fitted, sequences, top_k=4)
    random_accuracies, _ = measure_rank_accuracies(draft_for(bb, token_map=None), sequences, top_k=4)
    assert counts == [sum(ids.shape[1] - start - k - 1 for ids, start in sequences) for k in range(4)]
    assert all(sum(row) <= 1 + 1e-9 for row in accuracies)
    assert accuracies[0][0] > 0.8 and accuracies[3][0] > 0.5, accuracies
    assert all(row[0] < 0.2 for row in random_accuracies), random_accuracies


def test_a_config_json_lacking_the_draft_sizes_is_refused_naming_them():
    with pytest.raises(ValueError, match="lacks hidden_size, vocab_size"):
        Eagle3Config.from_dict({"architectures": ["LlamaForCausalLMEagle3"], "num_attention_heads": 4,
                                "intermediate_size": 128, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}})
