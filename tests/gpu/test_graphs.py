"""CUDA graphs in the decoder (marked ``gpu``: skipped without CUDA; ``pytest -m gpu`` where there is one).

Graphed decoding (``kv_cache="static", cuda_graphs=True``: the backbone's pass and the cache's compaction captured
once per tree size over one static cache and replayed, the heads' passes too) gives the tokens, steps and accepted
paths of eager decoding over the dynamic cache, in float32 on the GPU, with perturbed heads and a lookup chain (paths
of several nodes, compaction) and with a root-only tree (the plain step, graphed). On the CPU the static cache itself is checked against the dynamic one
(``tests/decoding/test_generate.py``).
"""

from __future__ import annotations

import pytest
import torch
from helpers.backbones import make_tiny_backbone
from helpers.decoding import hf_greedy, perturb_heads, prompts

from medusa_train import MedusaModel
from medusa_train.decoding import TokenTree, tree_generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_graphed_decoding_is_eager_decoding(arch):
    backbone = make_tiny_backbone(arch, seed=6)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    perturb_heads(model, seed=3, scale=0.01)
    model.cuda()
    lengths = []
    for i, ids in enumerate(prompts(3, seed=11)):
        ids = ids.cuda()
        reference = hf_greedy(backbone, ids, 30, eos_token_id=[])
        for tree in (TokenTree.from_name("default"), TokenTree([]), TokenTree.from_name("small").with_lookup(4)):
            eager = tree_generate(model, ids, tree, max_new_tokens=30, eos_token_id=[])
            graphed = tree_generate(model, ids, tree, max_new_tokens=30, eos_token_id=[],
                                      kv_cache="static", cuda_graphs=True)
            assert graphed.sequences.tolist() == eager.sequences.tolist() == reference.tolist(), (arch, i)
            assert graphed.accept_lengths == eager.accept_lengths
            lengths += graphed.accept_lengths
    assert max(lengths) >= 2  # steps of several nodes were replayed


def test_graphs_captured_once_serve_every_generation():
    """One ``StaticSteps(graphs=True)`` for several prompts and trees, as an evaluation keeps it: each tree size is
    captured once (again only when the cache grows) and every generation equals eager decoding."""
    from medusa_train.decoding.graphs import StaticSteps

    backbone = make_tiny_backbone("llama", seed=6)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    perturb_heads(model, seed=3, scale=0.01)
    model.cuda()
    steps = StaticSteps(model, graphs=True)
    trees = (TokenTree([]), TokenTree.from_name("small").with_lookup(4), TokenTree.from_name("default"))
    for ids in prompts(3, seed=11):
        ids = ids.cuda()
        for tree in trees:
            eager = tree_generate(model, ids, tree, max_new_tokens=30, eos_token_id=[])
            graphed = tree_generate(model, ids, tree, max_new_tokens=30, eos_token_id=[], steps=steps)
            assert graphed.sequences.tolist() == eager.sequences.tolist()
            assert graphed.accept_lengths == eager.accept_lengths
    assert steps.captures == len({t.num_nodes for t in trees}) and steps.length == 1024
    assert set(steps.compactions) == {t.num_nodes for t in trees}  # the compaction graphed per tree size too


def test_graphed_heads_propose_what_eager_heads_propose():
    """The heads' passes replayed from graphs too (``families/medusa/decode_state.py``: the prefix layer's read, one
    graph per count of accepted positions; the guesses, one per tree), for heads of the demo's kind (prefix
    attention, path input, a shared LM head, a draft vocabulary): every step's candidates those of eager decoding over
    the dynamic cache, float32, with one ``StaticSteps`` kept across prompts and trees as an evaluation keeps it."""
    from helpers.decoding import decode_recording_candidates as decode
    from helpers.decoding import repeating_prompts
    from helpers.heads import demo_like_heads

    from medusa_train.decoding.graphs import StaticSteps

    model = demo_like_heads(128, device="cuda")
    steps = StaticSteps(model, graphs=True)
    reads = []
    for ids in repeating_prompts():
        ids = ids.cuda()
        reference = hf_greedy(model.backbone, ids, 40, eos_token_id=[])
        # new tree objects for every prompt, of the same choices: the graphs captured for the first ones serve them
        trees = (TokenTree.from_name("default"), TokenTree.from_name("small").with_lookup(5))
        for tree in trees:
            eager, eager_proposed = decode(model, ids, tree)
            graphed, graphed_proposed = decode(model, ids, tree, steps=steps)
            assert graphed_proposed == eager_proposed, tree.num_nodes
            assert graphed.sequences.tolist() == eager.sequences.tolist() == reference.tolist()
            assert graphed.accept_lengths == eager.accept_lengths
            reads += graphed.accept_lengths
    # captured once each for every generation: a read graph per count of accepted positions, a guess graph per tree
    assert max(reads) >= 3 and len(steps.draft.reads) >= 3 and len(steps.draft.trees) == len(trees)
    assert steps.draft.captures == len(steps.draft.reads) + len(trees)


def test_a_graphed_eagle3_draft_proposes_what_the_eager_draft_proposes():
    """An EAGLE-3 draft's passes replayed from graphs (``families/eagle3/decode_state.py``: the read, one graph per
    count of verified positions; the tree, one per tree): every step's candidates those of eager decoding, float32,
    with one ``StaticSteps`` kept across prompts and trees."""
    from helpers.decoding import decode_recording_candidates as decode
    from helpers.decoding import repeating_prompts
    from helpers.heads import eagle3_like_draft

    from medusa_train.decoding.graphs import StaticSteps

    model = eagle3_like_draft(device="cuda")
    steps = StaticSteps(model, graphs=True)
    trees = (TokenTree.from_name("default"), TokenTree.chain(3))
    for ids in repeating_prompts():
        ids = ids.cuda()
        for tree in trees:
            eager, eager_proposed = decode(model, ids, tree)
            graphed, graphed_proposed = decode(model, ids, tree, steps=steps)
            assert graphed_proposed == eager_proposed, tree.num_nodes
            assert graphed.sequences.tolist() == eager.sequences.tolist()
    assert len(steps.draft.trees) == len(trees) and steps.draft.captures == len(steps.draft.reads) + len(trees)


def test_compiled_graphs_decode_as_eager_decoding():
    """``StaticSteps(compiled=True)``: each captured pass compiled by inductor first (the 8B shape's graphed plain step
    7.61 -> 5.72 ms on an H200, 2026-12-01). Opt-in (the decode benchmark's ``graphs=compiled``) until this passes on a
    GPU: the same tokens and steps as eager decoding, float32."""
    from medusa_train.decoding.graphs import StaticSteps

    backbone = make_tiny_backbone("llama", seed=6)
    model = MedusaModel.from_backbone(backbone, num_heads=4)
    perturb_heads(model, seed=3, scale=0.01)
    model.cuda()
    steps = StaticSteps(model, graphs=True, compiled=True)
    for ids in prompts(2, seed=11):
        ids = ids.cuda()
        for tree in (TokenTree([]), TokenTree.from_name("default")):
            eager = tree_generate(model, ids, tree, max_new_tokens=30, eos_token_id=[])
            compiled = tree_generate(model, ids, tree, max_new_tokens=30, eos_token_id=[], steps=steps)
            assert compiled.sequences.tolist() == eager.sequences.tolist()
            assert compiled.accept_lengths == eager.accept_lengths
    assert steps.captures == 2


def test_graphs_need_cuda_and_a_static_cache():
    model = MedusaModel.from_backbone(make_tiny_backbone("llama"), num_heads=4).cuda()
    with pytest.raises(ValueError, match="kv_cache='static'"):
        tree_generate(model, prompts(1)[0].cuda(), "default", max_new_tokens=3, cuda_graphs=True)


def test_evaluate_on_cuda_decodes_plain_graphed_beside_generate_and_divides_by_the_faster(tmp_path):
    """On CUDA an evaluation decodes with graphs by default (generation.cuda_graphs null): the "plain, graphed" row
    beside HF generate, every graphed output equal to plain greedy (float32), each tree size captured once for the
    whole run (in its warm-up), and every speedup divided by the faster plain row."""
    from helpers.training import make_model_dir

    from medusa_train import load_backbone
    from medusa_train.data.benchmarks import BenchPrompt
    from medusa_train.evaluation.evaluate import evaluate

    backbone, tokenizer = load_backbone(str(make_model_dir(tmp_path / "model")), dtype="float32", device_map="cuda")
    model = MedusaModel.from_backbone(backbone, num_heads=2).cuda().eval()
    perturb_heads(model, seed=3, scale=0.01)
    prompts_ = [BenchPrompt("r", "extraction", ["the cat sat on the mat. the cat sat on the mat. the cat"]),
                BenchPrompt("w", "writing", ["Hello there! How are you today?", "Now say it again."])]
    report = evaluate(model, tokenizer, prompts_, [[0], [1], [0, 0]], max_new_tokens=24, progress=False)
    rows, n = report["methods"], len(report["per_prompt"])
    assert report["settings"]["cuda_graphs"] is True and report["settings"]["graph_captures"] == 2  # 1 and 4 nodes
    assert report["settings"]["draft_graph_captures"] >= 2  # the heads' passes too: a read per count, a guess per tree
    assert rows["plain_graphed"]["tokens_per_forward"] == 1.0
    assert rows["plain_graphed"]["outputs"] == {"compared": n, "identical": n}
    assert rows["draft"]["outputs"] == {"compared": n, "identical": n}
    reference = max(("plain", "plain_graphed"), key=lambda m: rows[m]["tokens_per_s"])
    assert report["plain_reference"] == reference
    assert report["speedup"] == rows["draft"]["tokens_per_s"] / rows[reference]["tokens_per_s"]
