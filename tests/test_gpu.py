"""The decoding paths on CUDA (marked ``gpu``: skipped without CUDA, run on a machine that has it).

On CUDA the tree pass and the one-token forward run different GEMM kernels, so even float32 can round
differently at a near-tie; the property checked is the evaluation's: no generation parts from plain
greedy decoding except where the base model's two best tokens are within the dtype's rounding
(``mismatch_detail``'s ``at_rounding``), and most do not part at all.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from helpers.backbones import PACKAGED_MODEL
from helpers.training import make_model_dir

from medusa_train import MedusaModel, load_backbone, load_tokenizer
from medusa_train.cli.build_tree import build_build_tree_config, run
from medusa_train.decoding import MedusaTree, medusa_generate
from medusa_train.evaluation.evaluate import mismatch_detail

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
    tree = MedusaTree.from_name("default")
    identical, parted = 0, []
    for text in CHATS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"].to("cuda")
        ref = backbone.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=48,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        out = medusa_generate(model, ids, tree, max_new_tokens=48, eos_token_id=tokenizer.eos_token_id)
        assert out.sequences.device.type == "cuda"
        n = ids.shape[1]
        mine, plain = out.sequences[0, n:].tolist(), ref[0, n:].tolist()
        if mine == plain:
            identical += 1
            continue
        at = next((i for i, (a, b) in enumerate(zip(mine, plain)) if a != b), min(len(mine), len(plain)))
        detail = mismatch_detail(model, ids, plain, mine, at)
        parted.append((text, at, detail))
        assert detail["kind"] == "at_rounding", (text, detail)
    print(f"cuda {dtype}: {identical} of {len(CHATS)} identical; parted: {parted}")
    assert identical >= len(CHATS) // 2, parted


def test_build_tree_auto_times_its_cost_curve_on_cuda(tmp_path):
    backbone, _ = load_backbone(str(make_model_dir(tmp_path / "model")), dtype="float32")
    heads = MedusaModel.from_backbone(backbone, num_heads=3).save_pretrained(tmp_path / "heads")
    source = tmp_path / "calib.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Hello there!", "def add(a, b):", "One two"]))
    out = tmp_path / "tree.yaml"
    run(build_build_tree_config({
        "heads": str(heads), "nodes": "auto", "max_nodes": 16, "calibration": str(source), "num_prompts": 3,
        "max_new_tokens": 12, "exclude": None, "output": str(out), "device": "cuda", "cost_context": 32,
        "cost_repeats": 2}))
    data = yaml.safe_load(out.read_text())
    assert data["device"].startswith("cuda (") and data["dtype"] == "float32"
    verify = data["cost_curve"]["verify_ms"]
    assert all(ms > 0 for ms in verify.values()) and data["cost_curve"]["plain_ms"] > 0
    rate = {int(n): s["expected_tokens_per_s"] for n, s in data["sizes"].items()}
    assert data["chosen_nodes"] == max(rate, key=rate.get)
