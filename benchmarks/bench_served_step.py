"""A decode step in vLLM beside one of our decoder's, drafting K = 0..3 tokens, on one backbone and one draft.

    python -m benchmarks served_step                         # float32, 8 MT-Bench first turns, 96 tokens, K = 0..3
    python -m benchmarks served_step dtype=bfloat16 prompts=8 max_tokens=96 ks=1,2,3

The draft is an EAGLE-3 draft at random weights with a 4,096-token draft vocabulary (the shapes ``experiment=eagle3``
trains, saved as ``train`` exports it): it accepts next to nothing, so a step is what drafting K tokens and verifying
K + 1 costs, whatever a trained draft would accept. Every row runs the packaged model in ``dtype`` on the same prompts:

- **vLLM** (``.venv-vllm``, started by the toolkit, greedy, concurrency 1): one server per K (K = 0: no speculation)
  in the order 0, 1, 2, 3, 3, 2, 1, 0, each K's step the mean of its two runs, so a drift of the machine's speed
  through the run falls on every K alike; a step = the engine's own clock, its inter-token latency histogram's sum
  over its count (decode steps only, no prefill, no HTTP);
- **HF ``generate``** (the plain step every in-process speedup divides by) and **our decoder** with
  ``TokenTree.chain(K)``, the draft loaded as ``evaluate`` loads it (``load_exported_draft``: row kernel, grouped
  attention), taking turns prompt by prompt; a step = decode seconds over verify steps (HF: over its forwards after
  the prefill).

Each K's cost is set over the plain step of its own side (vLLM's K = 0, HF ``generate``): the step-cost table's
``served`` rows (``docs/results.md``). Options (``key=value``): dtype (float32), prompts (8), max_tokens (96), ks
(``1,2,3``), vocab (4096), out (default ``outputs/bench/served-step-<dtype>.json``), vllm (``true``; ``false``: our
side alone).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODEL = "packaged:smollm2-135m-instruct"


def random_draft(folder: Path, dtype: str, depth: int, vocab: int) -> Path:
    """An EAGLE-3 draft at random weights for the packaged model (``vocab`` draft tokens: the first ids stand in for
    the most frequent, which costs the same), saved as training exports one."""
    from medusa_train.backbone.load import load_backbone
    from medusa_train.families.eagle3.model import Eagle3Model

    backbone, _ = load_backbone(MODEL, dtype="float32")
    torch.manual_seed(0)
    draft = Eagle3Model.from_backbone(backbone, token_map=torch.arange(vocab), ttt_steps=depth, dtype=dtype)
    return draft.save_pretrained(folder)


def ours(draft_folder: Path, dtype: str, conversations: list[list[dict]], max_tokens: int, ks: list[int]) -> dict:
    """HF ``generate``'s step and our decoder's at each K, taking turns prompt by prompt (the first prompt once
    untimed): ``{"plain": {...}, "K=1": {...}, ...}`` with ``step_ms`` (the median over prompts), ``steps`` and
    ``tokens``, and whether every K's replies equal HF's (``same``)."""
    from medusa_train.backbone.generation import encode_chat, eos_token_ids, plain_generate
    from medusa_train.config.model import EvalModelConfig
    from medusa_train.decoding import TokenTree, tree_generate
    from medusa_train.model.load import load_exported_draft

    model, tokenizer = load_exported_draft(draft_folder, EvalModelConfig(dtype=dtype), device="cpu")
    eos = eos_token_ids(model.backbone, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    rows = {name: {"step_ms": [], "steps": 0, "tokens": 0, "same": 0} for name in ["plain", *(f"K={k}" for k in ks)]}
    with torch.no_grad():
        for i, messages in enumerate([conversations[0], *conversations]):
            ids = encode_chat(tokenizer, messages)
            plain, timing = plain_generate(model.backbone, ids, max_tokens, eos, pad)
            runs = [("plain", plain, timing["decode_s"], timing["forwards"] - 1)]
            for k in ks:
                out = tree_generate(model, ids, TokenTree.chain(k), max_new_tokens=max_tokens, eos_token_id=eos)
                runs.append((f"K={k}", out.sequences[0, ids.shape[1]:].tolist(), out.timings["decode_s"], out.steps))
            if i == 0:
                continue  # warm-up
            for name, tokens, seconds, steps in runs:
                row = rows[name]
                row["step_ms"].append(1e3 * seconds / max(steps, 1))
                row["steps"] += steps
                row["tokens"] += len(tokens)
                row["same"] += tokens == plain
    for row in rows.values():
        row["step_ms"] = statistics.median(row["step_ms"])
    return rows


def served(draft_folder: Path, dtype: str, conversations: list[list[dict]], max_tokens: int, ks: list[int],
           log_dir: Path) -> dict:
    """vLLM's step at K = 0 and each of ``ks``, one server each, in the order 0, ks, ks reversed, 0 (each K timed
    twice, a drift of the machine's speed through the run falling on every K alike): ``{"K=0": {...}, ...}`` with
    ``step_ms`` the mean of the two, ``step_ms_runs`` both, and each run's phase as ``measure_phase`` reports it
    (``step_ms``: the engine's mean decode step)."""
    from medusa_train.backbone.load import load_without_weights
    from medusa_train.engine import VllmServer
    from medusa_train.evaluation.served import measure_phase

    _, eos, _, folder = load_without_weights(MODEL)  # a client's view: the end-of-turn ids and the folder served
    runs: dict[str, list[dict]] = {}
    for i, k in enumerate([0, *ks, *reversed(ks), 0]):
        name = f"K={k}"
        spec = {"method": "eagle3", "model": str(draft_folder), "num_speculative_tokens": k} if k else None
        print(f"[served_step] vLLM {dtype}, {name}: starting a server", flush=True)
        with VllmServer(folder, dtype=dtype, speculative_config=spec, log_path=log_dir / f"vllm-{i}-{name}.log") as client:
            client.chat(conversations[0], max_tokens=8, stop_token_ids=eos)  # untimed warm-up
            time.sleep(1.0)
            phase = measure_phase(client, conversations, max_tokens, eos)
        runs.setdefault(name, []).append(phase)
        print(f"[served_step] vLLM {dtype}, {name}: {phase['step_ms']:.1f} ms a step, "
              f"{phase['tokens_per_step']:.3f} tokens per step", flush=True)
    return {name: {"step_ms": statistics.mean(r["step_ms"] for r in phases),
                   "step_ms_runs": [r["step_ms"] for r in phases],
                   "tokens_per_step": statistics.mean(r["tokens_per_step"] for r in phases), "runs": phases}
            for name, phases in runs.items()}


def main(dtype: str = "float32", prompts: str = "8", max_tokens: str = "96", ks: str = "1,2,3", vocab: str = "4096",
         out: str | None = None, vllm: str = "true") -> int:
    from medusa_train.data.benchmarks import load_benchmark

    depths = [int(k) for k in str(ks).split(",") if k.strip()]
    if not depths or min(depths) < 1:
        raise SystemExit(f"ks={ks!r}: give the drafted tokens to time, each >= 1 (K = 0 is always timed)")
    n, new = int(prompts), int(max_tokens)
    conversations = [[{"role": "user", "content": p.turns[0]}] for p in load_benchmark(limit=n, pick="spread")]
    output = Path(out or f"outputs/bench/served-step-{dtype}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="served-step-"))
    draft = random_draft(root / "draft", dtype, max(depths), int(vocab))
    result = {"machine": _machine(getattr(torch, dtype)), "dtype": dtype, "prompts": n, "max_tokens": new,
              "ours": ours(draft, dtype, conversations, new, depths)}
    output.write_text(json.dumps(result, indent=2))  # our side is kept should a server fail
    if vllm.lower() == "true":
        result["vllm"] = served(draft, dtype, conversations, new, depths, root)
        output.write_text(json.dumps(result, indent=2, default=str))
    print(table(result))
    print(f"written: {output} (servers' logs under {root})")
    return 0


def table(result: dict) -> str:
    """The step-cost rows: each side's step (ms) and over its plain step, K = 0..3."""
    ours_rows, served_rows = result["ours"], result.get("vllm")
    ks = [name for name in ours_rows if name != "plain"]
    lines = [f"packaged model, {result['dtype']}, {result['prompts']} MT-Bench first turns, {result['max_tokens']} "
             f"tokens, random EAGLE-3 draft; {result['machine']}",
             "| side | plain step (ms) | " + " | ".join(ks) + " |", "|---|---:|" + "---:|" * len(ks)]
    plain = ours_rows["plain"]["step_ms"]
    cells = [f"{ours_rows[k]['step_ms']:.1f} ({ours_rows[k]['step_ms'] / plain:.2f}x)" for k in ks]
    same = min(ours_rows[k]["same"] for k in ks)
    lines.append(f"| HF generate / our decoder (replies = HF's: {same}/{result['prompts']}) | {plain:.1f} | "
                 + " | ".join(cells) + " |")
    if served_rows:
        base = served_rows["K=0"]["step_ms"]
        cells = [f"{served_rows[k]['step_ms']:.1f} ({served_rows[k]['step_ms'] / base:.2f}x)" for k in ks]
        lines.append(f"| vLLM | {base:.1f} | " + " | ".join(cells) + " |")
        spread = "; ".join(f"{k} " + " / ".join(f"{v:.1f}" for v in served_rows[k]["step_ms_runs"])
                           for k in served_rows)
        lines.append(f"vLLM's two runs of each K (ms; first, then last): {spread}")
        accepted = ", ".join(f"{k} {served_rows[k]['tokens_per_step']:.3f}" for k in ks)
        lines.append(f"tokens per step served (a random draft: ~1): {accepted}")
    return "\n".join(lines)


def _machine(dtype: torch.dtype) -> str:
    from medusa_train.backbone.rows import linears_for
    from medusa_train.tree.cost import device_name

    return f"{device_name(torch.device('cpu'))}, linears: " \
           f"{linears_for(torch.device('cpu'), dtype)}"
