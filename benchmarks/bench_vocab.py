"""What a draft vocabulary (``heads.draft_vocab_size=K``) costs the heads: coverage and, given heads, accuracy.

    python -m benchmarks vocab data=<distilled.jsonl> sizes=1024,2048,4096,8192,16384
    python -m benchmarks vocab data=<distilled.jsonl> heads=<export folder> nodes=64

The draft vocabulary is the K most frequent targets of the training split, as training picks it
(the same split: ``max_length``, ``eval_size``, ``seed`` as in training). On the held-out split (the
backbone's own greedy replies when ``data`` is self-distilled, i.e. what decoding meets):

- ``coverage``: the fraction of reply tokens inside the K. A head loses only positions whose target
  lies outside, so ``1 - coverage`` bounds what any head can lose per position.
- with ``heads=``: each head's rank accuracies measured as the tree builder calibrates (teacher-forced
  on the replies), with the whole vocabulary and restricted to the K (``restrict_heads``: the same
  weights scoring only the K, where training with ``heads.draft_vocab_size=K`` starts), and the expected
  accepted length of the ``nodes``-node tree fitted to each.

Options (``key=value``): data (required), heads, model (default: the heads' backbone, else the packaged
model), dtype (float32), sizes (1024,2048,4096,8192,16384), nodes (64), max_length (1024), eval_size
(0.05), seed (0), max_eval (40 held-out conversations measured with heads=), threads, output (JSON,
default ``outputs/bench/vocab.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.bench_options import bench_options
from benchmarks.restrict import restrict_heads
from medusa_train import MedusaModel, load_backbone
from medusa_train.data import build_datasets
from medusa_train.data.tokenize import IGNORE_INDEX
from medusa_train.model.draft_vocab import most_frequent_tokens
from medusa_train.tree.calibrate import measure_rank_accuracies
from medusa_train.tree.fit import build_tree, expected_accept_length

DEFAULTS = dict(data=None, heads=None, model=None, dtype="float32", sizes="1024,2048,4096,8192,16384", nodes=64,
                max_length=1024, eval_size=0.05, seed=0, max_eval=40, threads=None, output=None)


def main(**overrides) -> int:
    opts = bench_options(DEFAULTS, overrides)
    if opts is None:
        return 2
    if not opts["data"]:
        print("data=<source> is required")
        return 2
    name = opts["model"]
    if name is None and opts["heads"]:
        name = json.loads((Path(opts["heads"]) / "config.json").read_text()).get("base_model_name_or_path")
    backbone, tokenizer = load_backbone(name or "packaged:smollm2-135m-instruct", dtype=opts["dtype"])
    vocab = backbone.get_output_embeddings().weight.shape[0]
    eval_size = float(opts["eval_size"]) if "." in str(opts["eval_size"]) else int(opts["eval_size"])
    train, evals, _ = build_datasets(tokenizer, opts["data"], int(opts["max_length"]), None, eval_size, int(opts["seed"]))
    held_out = torch.cat([torch.as_tensor(e["labels"]) for e in evals])
    held_out = held_out[held_out != IGNORE_INDEX]
    sizes = [int(k) for k in str(opts["sizes"]).split(",")]
    maps = {k: most_frequent_tokens((e["labels"] for e in train), k, vocab) for k in sizes}
    print(f"\nDraft vocabulary from {len(train)} training conversations of {opts['data']}; held out: {len(evals)} "
          f"conversations, {len(held_out)} reply tokens; vocabulary {vocab}.\n")

    full = None
    if opts["heads"]:
        full = MedusaModel.from_pretrained(opts["heads"], backbone=backbone).eval()
        sequences = []
        for e in evals[: int(opts["max_eval"])]:
            labels = torch.as_tensor(e["labels"])
            trained = (labels != IGNORE_INDEX).nonzero()
            if len(trained):
                sequences.append((torch.as_tensor(e["input_ids"])[None], int(trained[0])))
        nodes = int(opts["nodes"])
        accuracies, _ = measure_rank_accuracies(full, sequences)
        full_row = {"tau": expected_accept_length(build_tree(accuracies, nodes), accuracies),
                    "top1": [a[0] for a in accuracies]}
    rows = []
    header = "| K | share of vocabulary | held-out coverage |" + (
        f" expected accepted length ({opts['nodes']} nodes) | top-1 by head |" if full else "")
    print(header)
    print("|" + "---:|" * (header.count("|") - 1))
    if full:
        print(f"| {vocab} (all) | 100% | 100% | {full_row['tau']:.3f} | "
              f"{' / '.join(f'{a:.3f}' for a in full_row['top1'])} |")
    for k in sizes:
        coverage = torch.isin(held_out, maps[k]).float().mean().item()
        row = {"k": k, "coverage": coverage}
        line = f"| {k} | {k / vocab:.1%} | {coverage:.1%} |"
        if full:
            restricted = restrict_heads(full, maps[k])
            accuracies, _ = measure_rank_accuracies(restricted, sequences)
            row |= {"tau": expected_accept_length(build_tree(accuracies, nodes), accuracies),
                    "top1": [a[0] for a in accuracies]}
            line += f" {row['tau']:.3f} | {' / '.join(f'{a:.3f}' for a in row['top1'])} |"
        rows.append(row)
        print(line)
    output = Path(opts["output"] or "outputs/bench/vocab.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"settings": opts, "vocab": vocab, "held_out_tokens": len(held_out),
                                  "full": full_row if full else None, "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {output}")
    return 0
