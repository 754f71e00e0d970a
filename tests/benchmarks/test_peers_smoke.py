"""``benchmarks/bench_peers.py``: Model Optimizer's Medusa heads, written by the benchmark, load in our decoder and
decode losslessly. Runs only where ``nvidia-modelopt`` is importable (its own venv, ``scripts/peers_env.sh``)."""

import pytest
import torch

pytest.importorskip("modelopt.torch.speculative", reason="nvidia-modelopt lives in .venv-peers, not in CI")

from benchmarks.bench_peers import IGNORE, collate, steps_for, write_medusa  # noqa: E402
from medusa_train.decoding import TokenTree, tree_generate  # noqa: E402
from medusa_train.model.load import load_draft  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_collate_shifts_labels_as_the_peer_reads_them():
    batch = collate("medusa", 0, True)([{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]},
                                        {"input_ids": [8, 9], "labels": [IGNORE, 9]}])
    assert batch["labels"].tolist() == [[6, 7, IGNORE], [9, IGNORE, IGNORE]]
    eagle = collate("eagle3", 0, True)([{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}])
    assert eagle["loss_mask"].tolist() == [[1, 1, 0]]


def test_steps_count_as_each_loop_does():
    assert steps_for(17, {"epochs": 4, "batch_size": 8, "drop_last": False}) == 12
    assert steps_for(17, {"epochs": 1, "batch_size": 8, "drop_last": True}) == 2


def test_peer_medusa_heads_load_in_our_decoder_and_decode_losslessly(tiny_llama, tmp_path):
    import modelopt.torch.speculative as mtsp

    mtsp.convert(tiny_llama, [("medusa", {"medusa_num_heads": 2, "medusa_num_layers": 1})])
    with torch.no_grad():
        for p in tiny_llama.medusa_heads.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.1)
    write_medusa(tiny_llama, tmp_path, base="unused")
    model = load_draft(tmp_path / "export", tiny_llama).eval()
    hidden = torch.randn(1, 3, model.config.hidden_size)
    ours = [head(hidden) for head in model.heads]
    theirs = [head(hidden) for head in tiny_llama.medusa_heads]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
    ids = torch.tensor([[1, 5, 9, 13]])
    out = tree_generate(model, ids, TokenTree.chain(2), max_new_tokens=6)
    plain = tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)
    assert torch.equal(out.sequences[0, :plain.shape[1]], plain[0, :out.sequences.shape[1]])
