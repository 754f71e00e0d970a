"""CUDA graphs in the decoder (marked ``gpu``: skipped without CUDA; ``pytest -m gpu`` where there is one).

Graphed decoding (``kv_cache="static", cuda_graphs=True``: the backbone's pass captured once per tree size over one
static cache and replayed) gives the tokens, steps and accepted paths of eager decoding over the dynamic cache, in
float32 on the GPU, with perturbed heads and a lookup chain (paths of several nodes, compaction) and with a
root-only tree (the plain step, graphed). On the CPU the static cache itself is checked against the dynamic one
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


def test_graphs_need_cuda_and_a_static_cache():
    model = MedusaModel.from_backbone(make_tiny_backbone("llama"), num_heads=2).cuda()
    with pytest.raises(ValueError, match="kv_cache='static'"):
        tree_generate(model, prompts(1)[0].cuda(), "default", max_new_tokens=3, cuda_graphs=True)
