"""tree_generate: greedy Medusa decoding is token-identical to plain greedy decoding.

Parity is checked with heads that disagree with the base (heads at init, perturbed heads) and with
"oracle" heads that know the true continuation, so that long, branching accepted paths (and the
KV compaction of non-contiguous tree nodes) are exercised.
"""

from __future__ import annotations

import pytest
import torch
from helpers.backbones import CACHE_KINDS, make_cache_kind_backbone, make_tiny_backbone
from helpers.decoding import hf_greedy, install_oracle_heads, perturb_heads, prompts
from transformers import DynamicCache, StaticCache

from medusa_train import MedusaModel
from medusa_train.decoding import TokenTree, tree_generate
from medusa_train.decoding.generate import compact_cache, verify_tree
from medusa_train.evaluation.compare import mismatch_detail

ARCHS = ["llama", "qwen2", "gpt_neox"]
ATTNS = ["sdpa", "eager"]


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def count_decoder_calls(model: MedusaModel) -> list[int]:
    calls = [0]
    model.backbone.get_decoder().register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


# ------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_heads_at_init(arch, attn):
    backbone = make_tiny_backbone(arch, seed=1, attn_implementation=attn)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    tree = TokenTree.from_name("default")
    steps = gained = 0
    for i, ids in enumerate(prompts(3, seed=ARCHS.index(arch))):
        for n in (1, 9, 30):
            ref = hf_greedy(backbone, ids, n, eos_token_id=1)
            out = tree_generate(model, ids, tree, max_new_tokens=n, eos_token_id=1)
            assert out.sequences.tolist() == ref.tolist(), (arch, attn, i, n)
            assert out.new_tokens == ref.shape[1] - ids.shape[1] == sum(out.accept_lengths)
            assert out.steps == len(out.accept_lengths) and all(a >= 1 for a in out.accept_lengths)
            steps, gained = steps + out.steps, gained + out.new_tokens
    assert steps > 0 and gained >= steps


@pytest.mark.parametrize("arch, attn, tree_name", [("llama", "sdpa", "default"), ("gpt_neox", "eager", "chain"),
                                                   ("qwen2", "eager", "small")])
def test_greedy_parity_random_heads(arch, attn, tree_name):
    backbone = make_tiny_backbone(arch, seed=2, attn_implementation=attn)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    perturb_heads(model, seed=3)
    tree = TokenTree.from_name(tree_name, num_heads=4)
    lengths = []
    for ids in prompts(4, seed=5):
        ref = hf_greedy(backbone, ids, 25, eos_token_id=[1, 2])
        out = tree_generate(model, ids, tree, max_new_tokens=25, eos_token_id=[1, 2])
        assert out.sequences.tolist() == ref.tolist()
        lengths += out.accept_lengths
    assert 1 in lengths  # the heads really disagree with the base


@pytest.mark.parametrize("arch", ARCHS)
def test_a_root_only_tree_is_plain_greedy_decoding(arch):
    """nodes=auto picks the root alone where no tree pays: exactly plain greedy, and as many forwards after the prefill
    as generate's (one per token after the first: the last token, known from the step before, takes none)."""
    backbone = make_tiny_backbone(arch, seed=2)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    perturb_heads(model, seed=3)
    for ids in prompts(3, seed=7):
        ref = hf_greedy(backbone, ids, 20, eos_token_id=[])
        out = tree_generate(model, ids, TokenTree([]), max_new_tokens=20, eos_token_id=[])
        assert out.sequences.tolist() == ref.tolist() and out.steps == 19 and (out.new_tokens - 1) / out.steps == 1.0


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_oracle_heads_long_paths(arch, attn):
    backbone = make_tiny_backbone(arch, seed=4, attn_implementation=attn)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    tree = TokenTree.from_name("default")
    calls = count_decoder_calls(model)
    all_lengths = []
    for i, ids in enumerate(prompts(2, seed=7)):
        ref = hf_greedy(backbone, ids, 40, eos_token_id=[])
        install_oracle_heads(model, ref, seed=i)
        calls[0] = 0
        out = tree_generate(model, ids, tree, max_new_tokens=40, eos_token_id=[])
        assert out.sequences.tolist() == ref.tolist()
        assert calls[0] == out.steps + 1  # prefill + one verify pass per step, no re-forward
        all_lengths += out.accept_lengths
    mean = sum(all_lengths) / len(all_lengths)
    assert mean > 1.5, mean
    assert max(all_lengths) >= 4


def oracle_model(arch: str, seed: int, prompt_seed: int, new_tokens: int = 40):
    """A tiny backbone and 4 heads that know its greedy continuation of one prompt: (model, ids, reference)."""
    backbone = make_tiny_backbone(arch, seed=seed)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    ids = prompts(1, seed=prompt_seed)[0]
    ref = hf_greedy(backbone, ids, new_tokens, eos_token_id=[])
    install_oracle_heads(model, ref)
    return model, ids, ref


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_static_cache_decodes_what_the_dynamic_one_does(arch, attn):
    """``kv_cache="static"`` (one buffer for the whole generation, nodes compacted in place, stale slots masked):
    the same tokens, steps and accepted paths as the dynamic cache, side branches and lookup chains included,
    and both plain greedy."""
    backbone = make_tiny_backbone(arch, seed=6, attn_implementation=attn)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    for i, ids in enumerate(prompts(2, seed=11)):
        reference = hf_greedy(backbone, ids, 30, eos_token_id=[])
        install_oracle_heads(model, reference, seed=i)
        for tree in (TokenTree.from_name("default"), TokenTree.chain(1), TokenTree([]),
                     TokenTree.from_name("small").with_lookup(4)):
            dynamic = tree_generate(model, ids, tree, max_new_tokens=30, eos_token_id=[])
            static = tree_generate(model, ids, tree, max_new_tokens=30, eos_token_id=[], kv_cache="static")
            assert static.sequences.tolist() == dynamic.sequences.tolist() == reference.tolist(), (arch, attn, i)
            assert static.accept_lengths == dynamic.accept_lengths
            assert static.accepted_depths == dynamic.accepted_depths
        assert max(dynamic.accept_lengths) >= 2
    with pytest.raises(ValueError, match="kv_cache='paged'"):
        tree_generate(model, ids, "default", max_new_tokens=3, kv_cache="paged")
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA model"):  # graphs: tests/gpu/test_graphs.py
        tree_generate(model, ids, "default", max_new_tokens=3, kv_cache="static", cuda_graphs=True)


def test_one_static_cache_kept_across_generations_decodes_what_a_fresh_dynamic_one_does():
    """``StaticSteps`` (what an evaluation decodes every prompt with: one static cache reset in place between
    generations, grown when a text needs more room): every generation, trees of several sizes in turn and a text
    longer than the cache had room for, gives the tokens and steps of a fresh dynamic cache."""
    from medusa_train.decoding.graphs import StaticSteps

    backbone = make_tiny_backbone("llama", seed=6)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    steps = StaticSteps(model, length_step=32)
    trees = (TokenTree([]), TokenTree.from_name("small").with_lookup(4), TokenTree.from_name("default"))  # growing
    lengths = []
    for i, ids in enumerate(prompts(3, seed=11)):
        reference = hf_greedy(backbone, ids, 40, eos_token_id=[])
        install_oracle_heads(model, reference, seed=i)
        for tree in trees:
            for new_tokens in (20, 40):  # the second needs more room than the first left (32-token steps)
                dynamic = tree_generate(model, ids, tree, max_new_tokens=new_tokens, eos_token_id=[])
                kept = tree_generate(model, ids, tree, max_new_tokens=new_tokens, eos_token_id=[], steps=steps)
                assert kept.sequences.tolist() == dynamic.sequences.tolist() == reference[:, :ids.shape[1] + new_tokens].tolist()
                assert kept.accept_lengths == dynamic.accept_lengths, (i, tree.num_nodes, new_tokens)
                lengths.append(steps.length)
    assert max(dynamic.accept_lengths) >= 2 and len(set(lengths)) >= 2  # paths of several nodes; the cache grew
    assert steps.backbone_pass is None and steps.captures == 0  # no graphs on the CPU
    with pytest.raises(ValueError, match="compiled=True compiles the pass each graph captures"):
        StaticSteps(model, compiled=True)  # compiled graphs: tests/gpu/test_graphs.py


def test_every_node_slot_moved_at_once_is_the_compaction():
    """``move_slots`` (what a graphed compaction replays, ``StaticSteps.compact``: each node slot of the pass moved
    at once, the accepted path's to the first slots and the rest to themselves, with indices on the device) leaves
    a static cache as ``compact_cache`` does: the text's keys and values and its length, for paths in order, with
    side branches, of the root alone and of the whole deepest branch."""
    from medusa_train.decoding.graphs import move_slots
    from medusa_train.decoding.tree import fill_step_mask

    backbone = make_tiny_backbone("llama", seed=6)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    tree = TokenTree.from_name("default")
    ids = prompts(1, seed=11)[0]
    n, past = tree.num_nodes, ids.shape[1]
    for path in ([0], [0, 1, 2], [0, 3, 17], [0, *tree.retrieve_paths[-1][tree.retrieve_paths[-1] >= 0].tolist()[1:]]):
        caches = []
        for _ in range(2):
            cache = StaticCache(config=backbone.config, max_cache_len=past + n + 8)
            model(ids, past_key_values=cache, use_cache=True)
            mask = fill_step_mask(torch.empty(n, past + n + 8), tree.attention_mask(), past)
            model(torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(1)),
                  attention_mask=mask[None, None], position_ids=(past + tree.position_offsets)[None],
                  past_key_values=cache, use_cache=True)
            caches.append(cache)
        before = caches[1].layers[0].keys.clone()
        compact_cache(caches[0], past, path)
        source = torch.tensor([*path, *range(len(path), n)]) + past
        move_slots(caches[1], source, past + torch.arange(n), torch.tensor(past + len(path)))
        kept = past + len(path)
        for a, b in zip(caches[0].layers, caches[1].layers):
            assert int(a.cumulative_length) == int(b.cumulative_length) == kept, path
            assert torch.equal(a.keys[:, :, :kept], b.keys[:, :, :kept]) and torch.equal(a.values[:, :, :kept],
                                                                                         b.values[:, :, :kept])
        for i, node in enumerate(path):  # node path[i] now at slot past + i
            assert torch.equal(caches[1].layers[0].keys[:, :, past + i], before[:, :, past + node])


def test_oracle_paths_take_side_branches():
    """The accepted nodes are not always a prefix of the node order, so KV entries really move."""
    model, ids, ref = oracle_model("llama", seed=4, prompt_seed=7)
    tree = TokenTree.from_name("default")
    moved = []
    import medusa_train.decoding.generate as generate_module

    original = generate_module.compact_cache

    def spy(cache, past_len, path):
        moved.append(path != list(range(len(path))))
        return original(cache, past_len, path)

    generate_module.compact_cache = spy
    try:
        out = tree_generate(model, ids, tree, max_new_tokens=40, eos_token_id=[])
    finally:
        generate_module.compact_cache = original
    assert out.sequences.tolist() == ref.tolist()
    assert any(moved)


def test_eos_mid_accepted_path_is_kept_and_ends_generation():
    backbone = make_tiny_backbone("qwen2", seed=6)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    tree = TokenTree.from_name("default")
    ids = prompts(1, seed=11)[0]
    free = hf_greedy(backbone, ids, 40, eos_token_id=[])[0, ids.shape[1]:].tolist()
    install_oracle_heads(model, torch.cat([ids, torch.tensor([free])], dim=1))
    cut_mid_path = 0
    for pos in range(2, 30):
        eos = free[pos]
        if eos in free[:pos]:
            continue  # only first occurrences, so the stop position is ``pos``
        ref = hf_greedy(backbone, ids, 40, eos_token_id=eos)
        out = tree_generate(model, ids, tree, max_new_tokens=40, eos_token_id=eos)
        assert out.sequences.tolist() == ref.tolist()
        assert out.sequences[0, -1].item() == eos and out.new_tokens == pos + 1
        cut_mid_path += out.accepted_depths[-1] + 1 > out.accept_lengths[-1]
    assert cut_mid_path > 0


def test_max_new_tokens_is_exact():
    model, ids, ref = oracle_model("gpt_neox", seed=8, prompt_seed=13)
    tree = TokenTree.from_name("default")
    truncated = 0
    for n in range(1, 25):
        out = tree_generate(model, ids, tree, max_new_tokens=n, eos_token_id=[])
        assert out.sequences.shape == (1, ids.shape[1] + n)
        assert out.sequences.tolist() == ref[:, : ids.shape[1] + n].tolist()
        truncated += out.accepted_depths[-1] + 1 > out.accept_lengths[-1]
    assert truncated > 0
    assert tree_generate(model, ids, tree, max_new_tokens=0).sequences.tolist() == ids.tolist()


def test_default_eos_comes_from_generation_config():
    backbone = make_tiny_backbone("llama", seed=9)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    ids = prompts(1, seed=1)[0]
    free = hf_greedy(backbone, ids, 20, eos_token_id=[])[0, ids.shape[1]:].tolist()
    backbone.generation_config.eos_token_id = [free[5], 12345]
    out = tree_generate(model, ids, "default", max_new_tokens=20)
    assert out.sequences[0, ids.shape[1]:].tolist() == free[: free.index(free[5]) + 1]


BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7: spacing of bf16 numbers in [1, 2)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


@pytest.mark.parametrize("heads", ["perturbed", "oracle"])
@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_greedy_equals_plain_bf16_greedy_up_to_near_ties(arch, heads):
    """In bf16, Medusa's greedy output is plain bf16 greedy decoding's (``generate(do_sample=False)``).

    The tree pass sums attention over a different set of keys than the one-token-at-a-time forward, so
    the two can round differently; they may only part where the base model's two best next tokens are
    within bf16 rounding of each other (gap <= 2 eps max|logit|), measured by a plain bf16 forward of the
    common prefix, and both tokens must be among those best. (Measured on CPU with these seeds: llama parts
    on 2 of 6 prompts, qwen2 on 1, gpt_neox never; each time at a gap of 0 or one bf16 step.)"""
    backbone = make_tiny_backbone(arch, seed=0).to(torch.bfloat16)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    if heads == "perturbed":
        perturb_heads(model, seed=1)
    tree = TokenTree.from_name("default")
    identical, parted, lengths = 0, [], []
    for i, ids in enumerate(prompts(6, seed=0)):
        ref = hf_greedy(backbone, ids, 40, eos_token_id=[])
        if heads == "oracle":
            install_oracle_heads(model, ref, seed=i)
        out = tree_generate(model, ids, tree, max_new_tokens=40, eos_token_id=[])
        assert out.sequences.shape == ref.shape == (1, ids.shape[1] + 40)
        assert out.sequences[0, : ids.shape[1]].tolist() == ids[0].tolist()
        lengths += out.accept_lengths
        at = first_difference(out.sequences[0].tolist(), ref[0].tolist())
        if at is None:
            identical += 1
            continue
        with torch.no_grad():
            logits = backbone(ref[:, :at]).logits[0, -1].float()
        best, second = logits.topk(2).values.tolist()
        tolerance = 2 * BF16_EPS * logits.abs().max().item()
        parted.append((i, at, best - second, tolerance))
        assert best - second <= tolerance, (i, at, best, second, tolerance)
        for token in (out.sequences[0, at].item(), ref[0, at].item()):
            assert best - logits[token].item() <= tolerance, (i, at, token)
        # the evaluation's report files this difference as rounding, not as a bug
        n = ids.shape[1]
        detail = mismatch_detail(model, ids, ref[0, n:].tolist(), out.sequences[0, n:].tolist(), at - n)
        assert detail["kind"] == "at_rounding" and detail["tolerance"] == pytest.approx(tolerance, rel=1e-6)
    print(f"bf16 {arch} {heads} heads: {identical} of 6 identical; parted (prompt, position, gap, tol): {parted}")
    assert identical >= 3, parted  # a near-tie is the exception, not the rule
    assert max(lengths) >= (3 if heads == "oracle" else 1)  # oracle heads: multi-token steps in bf16 too


# ------------------------------------------------------------------------------------------ pieces
@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_pass_matches_plain_forward_of_each_path(arch, attn):
    """One forward of all tree nodes (4D additive mask, positions cache_len + depth) gives each node
    the logits of a plain forward over prompt + its root-to-node path."""
    backbone = make_tiny_backbone(arch, seed=12, attn_implementation=attn)
    model = MedusaModel.from_backbone(backbone, num_heads=3)
    tree = TokenTree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    prompt = prompts(1, seed=3)[0]
    tokens = torch.randint(3, 256, (tree.num_nodes,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = DynamicCache()
        model(prompt, past_key_values=cache, use_cache=True)
        _, logits = verify_tree(model, tokens, tree.attention_mask(), tree.position_offsets, cache, prompt.shape[1])
        assert cache.get_seq_length() == prompt.shape[1] + tree.num_nodes
        for node, path in enumerate(tree.node_paths()):
            nodes = [n for n in range(tree.num_nodes) if tree.visibility[node, n]]  # root .. node
            assert len(nodes) == len(path) + 1
            plain = model(torch.cat([prompt, tokens[nodes][None]], dim=1), return_base_logits=True)
            torch.testing.assert_close(logits[node], plain.base_logits[0, -1], atol=1e-5, rtol=1e-5)


def test_compact_cache_moves_accepted_nodes_into_place():
    cache = DynamicCache()
    past, nodes = 3, 7
    keys = torch.arange(past + nodes, dtype=torch.float).view(1, 1, -1, 1).repeat(1, 2, 1, 4)
    for layer_idx in range(2):
        cache.update(keys, -keys, layer_idx)
    compact_cache(cache, past, [0, 2, 5])
    assert cache.get_seq_length() == past + 3
    for layer in cache.layers:
        assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 5, 8]
        assert layer.values[0, 1, :, 0].tolist() == [0, -1, -2, -3, -5, -8]
    compact_cache(cache, 4, [0, 1])  # a prefix of the node order: only a crop
    assert cache.get_seq_length() == 6
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 5, 8]


# ------------------------------------------------------------------------------------------ errors
def test_errors(tiny_llama):
    model = MedusaModel.from_backbone(tiny_llama, num_heads=4)
    ids = prompts(1)[0]
    with pytest.raises(ValueError, match=r"tree path \[0, 0, 0, 0, 0\] needs 5 heads but the model has 4"):
        tree_generate(model, ids, TokenTree.chain(6))
    with pytest.raises(ValueError, match=r"batch size 1"):
        tree_generate(model, ids.repeat(2, 1), "default")
    with pytest.raises(ValueError, match=r"acceptance='beam'"):
        tree_generate(model, ids, "default", acceptance="beam")
    with pytest.raises(ValueError, match=r"max_new_tokens=-1"):
        tree_generate(model, ids, "default", max_new_tokens=-1)
    with pytest.raises(ValueError, match=r"top_p=0"):
        tree_generate(model, ids, "default", top_p=0, temperature=1.0)


def test_output_statistics():
    model, ids, _ = oracle_model("llama", seed=4, prompt_seed=7, new_tokens=30)
    out = tree_generate(model, ids, "default", max_new_tokens=30, eos_token_id=[])
    rates = out.head_acceptance_rates(num_heads=4)
    assert len(rates) == 4 and all(a >= b for a, b in zip(rates, rates[1:]))  # deeper needs shallower
    assert rates[0] == sum(d >= 1 for d in out.accepted_depths) / out.steps
    assert out.mean_accept_length == out.new_tokens / out.steps
    assert out.tree_nodes == TokenTree.from_name("default").num_nodes


# ------------------------------------------------------------------------------------------ real model
CHATS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]


@pytest.mark.slow
def test_greedy_parity_packaged_model(packaged_backbone):
    from medusa_train import load_tokenizer

    backbone, _ = packaged_backbone if isinstance(packaged_backbone, tuple) else (packaged_backbone, None)
    tokenizer = load_tokenizer("packaged:smollm2-135m-instruct")
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    tree = TokenTree.from_name("default")
    for text in CHATS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        ref = hf_greedy(backbone, ids, 32, eos_token_id=tokenizer.eos_token_id)
        out = tree_generate(model, ids, tree, max_new_tokens=32, eos_token_id=tokenizer.eos_token_id)
        assert out.sequences.tolist() == ref.tolist(), (text, tokenizer.decode(out.sequences[0, ids.shape[1]:]),
                                                        tokenizer.decode(ref[0, ids.shape[1]:]))


@pytest.mark.parametrize("name", [n for n in CACHE_KINDS if not n.startswith("mistral")])
def test_a_backbone_with_a_running_state_is_refused_before_decoding_with_the_layers_named(name):
    """Linear-attention, convolution and Mamba layers carry a state a tree's one-pass verify cannot follow or give
    back: the decoder (and the cost curve's steps) refuse such a backbone up front, naming its cache layers and the
    key to change, instead of failing inside the model (before: an IndexError from transformers at the prefill)."""
    from medusa_train.config.check import ConfigError
    from medusa_train.tree.cost import DecodeSteps

    model = MedusaModel.from_backbone(make_cache_kind_backbone(name), num_heads=2).eval()
    for decode in (lambda: tree_generate(model, torch.tensor([[5, 6, 7, 8]]), TokenTree([(0,), (0, 0)]),
                                         max_new_tokens=4, eos_token_id=[]),
                   lambda: DecodeSteps(model, context=8)):
        with pytest.raises(ConfigError, match=r"model\.name_or_path=.*cache holds .*(LinearAttention).*attention "
                                              r"layers only"):
            decode()


def test_a_sliding_window_backbone_decodes_as_plain_greedy_does():
    """A sliding-window cache is keys and values: decoded within its window, the tree's greedy output is the
    backbone's own."""
    backbone = make_cache_kind_backbone("mistral, sliding window 16")
    model = MedusaModel.from_backbone(backbone, num_heads=2).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    out = tree_generate(model, ids, TokenTree([(0,), (1,), (0, 0)]), max_new_tokens=8, eos_token_id=[])
    plain = backbone.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.sequences[0].tolist() == plain[0].tolist()


def test_a_tree_without_the_drafts_nodes_never_asks_the_draft():
    """The root alone (a plain step: evaluate's graphed plain row) and a lookup chain alone hold none of the draft's
    nodes: the decoder never asks the draft, so they cost what a decoder without one pays (before, each step ran the
    heads' read of the accepted tokens: 1.1 ms of a 23 ms bf16 step on the AMX CPU), and decode plain greedy. A tree
    with the draft's nodes asks it every step."""
    backbone = make_tiny_backbone("llama", seed=6)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    perturb_heads(model, seed=3, scale=0.01)
    asked = []
    propose = model.propose
    model.propose = lambda *args: asked.append(args[0].num_nodes) or propose(*args)
    ids = prompts(1, seed=11)[0]
    reference = hf_greedy(backbone, ids, 24, eos_token_id=[])
    for tree in (TokenTree([]), TokenTree([], lookup_depth=4)):
        out = tree_generate(model, ids, tree, max_new_tokens=24, eos_token_id=[])
        assert out.sequences.tolist() == reference.tolist() and asked == []
    out = tree_generate(model, ids, TokenTree.from_name("small").with_lookup(4), max_new_tokens=24, eos_token_id=[])
    assert out.sequences.tolist() == reference.tolist() and len(asked) == out.steps
