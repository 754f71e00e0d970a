"""Greedy decoding on CUDA (marked ``gpu``: skipped without CUDA, run on a machine that has it).

On CUDA the tree pass and the one-token forward run different GEMM kernels, so even float32 can round
differently at a near-tie; the property checked is the evaluation's: no generation parts from plain
greedy decoding except where the base model's two best tokens are within the dtype's rounding
(``mismatch_detail``'s ``at_rounding``), and most do not part at all. (``nodes=auto`` timing on CUDA:
tests/evaluation/test_cost.py, its ``cuda`` case.)
"""

from __future__ import annotations

import pytest
import torch
from helpers.backbones import PACKAGED_MODEL

from medusa_train import MedusaModel, load_backbone, load_tokenizer
from medusa_train.decoding import TokenTree, tree_generate
from medusa_train.evaluation.compare import first_difference, mismatch_detail

pytestmark = pytest.mark.gpu

CHATS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Explain what a hash table is to a ten-year-old.",
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_output_on_cuda_is_plain_greedy_decoding(dtype):
    backbone, _ = load_backbone(PACKAGED_MODEL, dtype=dtype, device_map="cuda")
    tokenizer = load_tokenizer(PACKAGED_MODEL)
    model = MedusaModel.from_backbone(backbone, num_heads=4).to("cuda").eval()
    assert all(p.device.type == "cuda" for p in model.parameters())
    tree = TokenTree.from_name("default")
    identical, parted = 0, []
    for text in CHATS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"].to("cuda")
        ref = backbone.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=48,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        out = tree_generate(model, ids, tree, max_new_tokens=48, eos_token_id=tokenizer.eos_token_id)
        assert out.sequences.device.type == "cuda"
        n = ids.shape[1]
        mine, plain = out.sequences[0, n:].tolist(), ref[0, n:].tolist()
        at = first_difference(plain, mine)
        if at is None:
            identical += 1
            continue
        detail = mismatch_detail(model, ids, plain, mine, at)
        parted.append((text, at, detail))
        assert detail["kind"] == "at_rounding", (text, detail)
    print(f"cuda {dtype}: {identical} of {len(CHATS)} identical; parted: {parted}")
    assert identical >= len(CHATS) // 2, parted

