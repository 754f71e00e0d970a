"""How often a tree-sized forward picks another greedy token than a one-token forward, in half precision.

    python -m benchmarks rounding dtype=bfloat16 prompts=8 chunk=8

Medusa's verify pass runs the backbone over several tokens at once; plain decoding runs one. In
bfloat16 the two round differently (other GEMM kernels, other summation orders), so where the top
two logits are within a rounding step of each other the greedy token can differ. This benchmark
decodes each MT-Bench first turn greedily with ``generate``, then runs the same tokens through the
backbone again, once a token at a time and once ``chunk`` tokens per forward (a chain verify pass),
and counts, per position, the greedy tokens that differ between the two passes with the LM head:

- ``bf16 head``: in the model's dtype on both sides (what is served today);
- ``fp32 head, verify only``: the LM head in float32 over the half-precision hidden states in the
  verify pass only (plain decoding is the user's ``generate``, unchanged);
- ``fp32 head, both``: float32 LM head on both sides (a different baseline than ``generate``).

It also counts exact ties of the top two half-precision logits and the largest hidden-state
difference between the passes. ``answers parting`` is 1 - (1 - rate)^max_new_tokens: the share of
answers expected to part from plain greedy somewhere in ``max_new_tokens`` tokens.

Options (``key=value``): model (the packaged one), dtype (bfloat16), prompts (8), max_new_tokens (128),
chunk (8), threads, output (JSON, default ``outputs/bench/rounding-<dtype>-chunk<chunk>.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import DynamicCache

from benchmarks.bench_options import bench_options
from medusa_train import load_backbone
from medusa_train.backbone.generation import encode_chat, plain_generate
from medusa_train.data.benchmarks import load_benchmark

DEFAULTS = dict(model="packaged:smollm2-135m-instruct", dtype="bfloat16", prompts=8, max_new_tokens=128, chunk=8,
                threads=None, output=None)


def hidden_states(decoder, sequence: torch.Tensor, prompt_len: int, chunk: int) -> torch.Tensor:
    """Final hidden states predicting each new token: the prompt in one pass, then ``chunk`` tokens a pass."""
    cache = DynamicCache()
    out = decoder(sequence[:, :prompt_len], past_key_values=cache, use_cache=True)
    rows = [out.last_hidden_state[0, -1:]]
    for start in range(prompt_len, sequence.shape[1] - 1, chunk):
        end = min(start + chunk, sequence.shape[1] - 1)
        rows.append(decoder(sequence[:, start:end], past_key_values=cache, use_cache=True).last_hidden_state[0])
    return torch.cat(rows)


@torch.no_grad()
def main(**overrides) -> int:
    """Run the benchmark and print a Markdown table. Options: see the module docstring."""
    opts = bench_options(DEFAULTS, overrides)
    if opts is None:
        return 2
    chunk, new_tokens = int(opts["chunk"]), int(opts["max_new_tokens"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backbone, tokenizer = load_backbone(opts["model"], dtype=opts["dtype"])
    backbone.to(device).eval()
    decoder, weight = backbone.get_decoder(), backbone.get_output_embeddings().weight
    weight32 = weight.float()
    counts = {"positions": 0, "bf16 head": 0, "fp32 head, verify only": 0, "fp32 head, both": 0,
              "exact top-2 ties, one-token pass": 0}
    largest_hidden_difference = 0.0
    for prompt in load_benchmark("packaged:mt-bench", limit=int(opts["prompts"])):
        ids = encode_chat(tokenizer, [{"role": "user", "content": prompt.turns[0]}]).to(device)
        plain, _ = plain_generate(backbone, ids, new_tokens, [], tokenizer.pad_token_id or 0)
        sequence = torch.cat([ids, torch.tensor([plain], device=device)], dim=1)
        one, many = (hidden_states(decoder, sequence, ids.shape[1], n) for n in (1, chunk))
        largest_hidden_difference = max(largest_hidden_difference, (one.float() - many.float()).abs().max().item())
        low_one, low_many = one @ weight.T, many @ weight.T
        high_one, high_many = (one.float() @ weight32.T).argmax(-1), (many.float() @ weight32.T).argmax(-1)
        counts["positions"] += one.shape[0]
        counts["bf16 head"] += int((low_one.argmax(-1) != low_many.argmax(-1)).sum())
        counts["fp32 head, verify only"] += int((low_one.argmax(-1) != high_many).sum())
        counts["fp32 head, both"] += int((high_one != high_many).sum())
        top = low_one.topk(2, dim=-1).values
        counts["exact top-2 ties, one-token pass"] += int((top[:, 0] == top[:, 1]).sum())
    positions = counts["positions"]
    print(f"\n{opts['model']}, {opts['dtype']}, {device}: {opts['prompts']} MT-Bench first turns, {positions} positions, "
          f"one-token pass against {chunk} tokens per pass; largest hidden-state difference "
          f"{largest_hidden_difference:.3f}\n")
    print(f"| | positions where the greedy token differs | rate | answers parting within {new_tokens} tokens |")
    print("|---|---:|---:|---:|")
    rows = {}
    for name, n in counts.items():
        if name == "positions":
            continue
        rate = n / max(positions, 1)
        rows[name] = {"count": n, "rate": rate, "answers_parting": 1 - (1 - rate) ** new_tokens}
        parting = f"{rows[name]['answers_parting']:.0%}" if "ties" not in name else ""
        print(f"| {name} | {n} | {rate:.2%} | {parting} |")
    output = Path(opts["output"] or f"outputs/bench/rounding-{opts['dtype']}-chunk{chunk}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"settings": {k: v for k, v in opts.items() if k != "output"} | {"device": device},
                                  "positions": positions, "largest_hidden_difference": largest_hidden_difference,
                                  "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {output}")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(**dict(arg.split("=", 1) for arg in sys.argv[1:])))
