"""The real decode loop against the timed verify step, round after round: what the tree builder's cost curve
misses, and how much the machine itself moves.

    python -m benchmarks loop heads=<export> tree=<tree YAML> rounds=3 prompts=8

Each round decodes ``prompts`` MT-Bench first turns with ``generate`` and with ``tree_generate`` (per
prompt, one after the other, as the evaluation does), timing the loop's phases inside it through its
``wrap_phase`` hook (the heads' candidates, the tree pass, the LM head, acceptance, cache compaction; on
CUDA each phase is synchronised, which adds a little), then times ``DecodeSteps``' plain, ``generate`` and
verify steps at the round's mean context (where ``build_tree nodes=auto`` times them too, by default). A
real step much dearer than the timed one in the same round is the loop's own cost; rounds that differ from
each other are the machine.

With ``graphs`` (``auto``: on CUDA, as ``evaluate`` decodes there) the loop decodes as a server steps: one static
cache kept across prompts, the backbone's passes and the heads' own replayed from CUDA graphs (``decoding/graphs.py``,
``families/medusa/decode_state.py``), and the timed steps are graphed too; ``generate`` stays HF's eager one.

Options (``key=value``): heads, tree (required), dtype (bfloat16), prompts (8), max_new_tokens (128),
rounds (3), repeats (10, timed-step rounds), threads, graphs (auto, true, false), output (JSON, default
``outputs/bench/loop.json``).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.bench_options import bench_options
from medusa_train.backbone.generation import encode_chat, eos_token_ids, now, plain_generate
from medusa_train.config.model import EvalModelConfig
from medusa_train.data.benchmarks import DEFAULT_BENCHMARK, load_benchmark
from medusa_train.decoding.generate import tree_generate
from medusa_train.decoding.graphs import StaticSteps, graphs_wanted
from medusa_train.evaluation.evaluate import resolve_tree
from medusa_train.model.load import load_exported_draft
from medusa_train.tree.cost import DecodeSteps, median_times

DEFAULTS = dict(heads=None, tree=None, dtype="bfloat16", prompts=8, max_new_tokens=128, rounds=3, repeats=10,
                threads=None, graphs="auto", output="outputs/bench/loop.json")
# the table's phase columns (``tree_generate``'s PHASES), in the order this table has always shown them
COLUMNS = ("candidates", "tree pass", "acceptance", "compaction", "LM head")


class PhaseClock:
    """Seconds spent in each phase of ``tree_generate``: its ``wrap_phase`` hook is ``wrap``."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = now(self.device)
            result = fn(*args, **kwargs)
            self.seconds[name] += now(self.device) - start
            return result
        return timed


@torch.no_grad()
def main(**overrides) -> int:
    """Run the benchmark and print a Markdown table. Options: see the module docstring."""
    opts = bench_options(DEFAULTS, overrides)
    if opts is None:
        return 2
    if not opts["heads"] or not opts["tree"]:
        print("heads=<exported heads> and tree=<tree YAML or name> are required")
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if opts["graphs"] not in ("auto", "true", "false"):
        print(f"graphs={opts['graphs']}: auto, true or false")
        return 2
    model, tokenizer = load_exported_draft(opts["heads"], EvalModelConfig(dtype=opts["dtype"]), device)
    graphs = graphs_wanted(None if opts["graphs"] == "auto" else opts["graphs"] == "true", model.lm_head.weight.device)
    replayed = StaticSteps(model, graphs=True) if graphs else None  # kept across prompts, as an evaluation keeps it
    tree = resolve_tree(opts["tree"], model.config.depth)
    eos = eos_token_ids(model.backbone)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    prompts = load_benchmark(DEFAULT_BENCHMARK, int(opts["prompts"]))
    inputs = [encode_chat(tokenizer, [{"role": "user", "content": p.turns[0]}]).to(device) for p in prompts]
    new_tokens = int(opts["max_new_tokens"])
    tree_generate(model, inputs[0], tree, max_new_tokens=16, steps=replayed)  # warm-up (and the graphs' captures)
    plain_generate(model.backbone, inputs[0], 16, eos, pad)

    rounds = []
    for r in range(int(opts["rounds"])):
        steps = tokens = plain_tokens = 0
        decode_s = plain_s = 0.0
        contexts = []
        clock = PhaseClock(model.lm_head.weight.device)
        for ids in inputs:
            plain, timing = plain_generate(model.backbone, ids, new_tokens, eos, pad)
            plain_tokens, plain_s = plain_tokens + len(plain) - 1, plain_s + timing["decode_s"]
            out = tree_generate(model, ids, tree, max_new_tokens=new_tokens, eos_token_id=eos,
                                  wrap_phase=clock.wrap, steps=replayed)
            # tokens after each reply's first per forward after its prefill, as generate_ms counts its tokens
            steps, tokens, decode_s = steps + out.steps, tokens + out.new_tokens - 1, decode_s + out.timings["decode_s"]
            contexts.append(ids.shape[1] + out.new_tokens // 2)
        phases = {k: v / max(steps, 1) * 1e3 for k, v in clock.seconds.items()}
        context = round(statistics.mean(contexts))
        timed = DecodeSteps(model, context, graphs=graphs)
        plain_ms, generate_ms, verify_ms = (s * 1e3 for s in median_times(
            [timed.plain_step, lambda steps=timed: steps.generate_per_token(32), timed.verify_step(tree)],
            int(opts["repeats"]), 2, timed.device))
        real = {"verify_ms": decode_s / max(steps, 1) * 1e3, "generate_ms": plain_s / max(plain_tokens, 1) * 1e3,
                "accepted_length": tokens / max(steps, 1)}
        rounds.append({"round": r + 1, "context": context, "real": real, "phases_ms": phases,
                       "timed": {"plain_ms": plain_ms, "generate_ms": generate_ms, "verify_ms": verify_ms},
                       "speedup_real": real["accepted_length"] * real["generate_ms"] / real["verify_ms"],
                       "speedup_from_timed": real["accepted_length"] * generate_ms / verify_ms})
        print(f"round {r + 1}: real verify {real['verify_ms']:.1f} ms/step (timed {verify_ms:.1f}), "
              f"generate {real['generate_ms']:.1f} ms/token (timed {generate_ms:.1f})", flush=True)

    print(f"\n{model.config.depth} heads, {tree.num_nodes}-node tree, {len(inputs)} prompts x {new_tokens} tokens, "
          f"{str(model.lm_head.weight.dtype).removeprefix('torch.')} on {device}, {torch.get_num_threads()} threads"
          + (", graphed (the heads' passes too)" if graphs else "") + "\n")
    names = list(COLUMNS)
    print("| round | context | real verify (ms) | " + " | ".join(names) + " | timed verify (ms) | real / timed | "
          "real generate (ms/token) | timed generate | accepted length | speedup (real) | speedup (timed steps) |")
    print("|---:|---:|---:|" + "---:|" * len(names) + "---:|---:|---:|---:|---:|---:|---:|")
    for row in rounds:
        real, timed = row["real"], row["timed"]
        print(f"| {row['round']} | {row['context']} | {real['verify_ms']:.1f} | "
              + " | ".join(f"{row['phases_ms'].get(n, 0.0):.1f}" for n in names)
              + f" | {timed['verify_ms']:.1f} | {real['verify_ms'] / timed['verify_ms']:.2f} | {real['generate_ms']:.1f} | "
              f"{timed['generate_ms']:.1f} | {real['accepted_length']:.2f} | {row['speedup_real']:.2f}x | "
              f"{row['speedup_from_timed']:.2f}x |")
    out = Path(opts["output"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"options": opts, "device": device, "graphs": graphs, "rounds": rounds},
                              indent=1))
    print(f"\nwrote {out}")
    return 0
