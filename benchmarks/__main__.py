"""Speed and memory benchmarks (never asserted in tests; figures go in docs/results.md), from the repository root:

    python -m benchmarks loss     # peak memory + time: naive vs head-by-head vs chunked loss
    python -m benchmarks decode   # verify-step cost vs plain decoding for several tree sizes, against the memory limit
    python -m benchmarks flex     # tree attention through FlexAttention beside SDPA's masked path
    python -m benchmarks train    # tokens/s per epoch, cached vs uncached hidden states
    python -m benchmarks vocab data=...  # what a draft vocabulary (heads.draft_vocab_size) costs the heads
    python -m benchmarks rounding  # how often a multi-token bf16 pass picks another greedy token
    python -m benchmarks loop heads=... tree=...  # the real decode loop against the timed verify step
    python -m benchmarks tokenize  # the data's tokenisation: first run, cached run, peak memory
    python -m benchmarks eagle3_served  # an EAGLE-3 draft in vLLM: a drafting step's cost, served = simulated
    python -m benchmarks served_step  # a step drafting K = 0..3 tokens: vLLM's beside our decoder's, same draft
    python -m benchmarks lookup_walk heads=... tree=...  # a lookup chain's expected gain: per position vs walked
    python -m benchmarks gpu_check heads=... prompts=...  # on a GPU: walk beside decoding, build-tree, evaluate
    python -m benchmarks big_vocab  # a draft's decode step against a plain one on a 262,144-token vocabulary
    python -m benchmarks curve    # the learning curve: tokens per step against distilled conversations, walked and served
    python -m benchmarks peers data=...  # Model Optimizer's Medusa + EAGLE-3 on our split (.venv-peers/bin/python)
    python -m benchmarks peers_score  # the peer table: the peers' drafts and ours walked, served and decoded alike

Extra ``key=value`` arguments are passed to the chosen benchmark. vLLM's num_speculative_tokens is chosen by the
installed command, ``medusa-train choose-k heads=...`` (one server per K, the fastest kept in serving.json).
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {"loss": "bench_loss", "decode": "bench_decode", "flex": "bench_flex", "train": "bench_train", "vocab": "bench_vocab",
              "rounding": "bench_rounding", "loop": "bench_loop", "tokenize": "bench_tokenize",
              "eagle3_served": "bench_eagle3_served", "served_step": "bench_served_step",
              "lookup_walk": "bench_lookup_walk",
              "gpu_check": "bench_gpu_check", "curve": "bench_curve", "big_vocab": "bench_big_vocab", "peers": "bench_peers",
              "peers_score": "bench_peers_score"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(f"{__package__}.{BENCHMARKS[argv[0]]}")
    overrides = dict(arg.split("=", 1) for arg in argv[1:])
    return module.main(**overrides) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
