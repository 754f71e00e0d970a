"""Speed and memory benchmarks (never asserted in tests; figures go in the README).

    python scripts/benchmark.py loss     # peak memory + time: naive vs head-by-head vs chunked loss
    python scripts/benchmark.py decode   # verify-step cost vs plain decoding for several tree sizes
    python scripts/benchmark.py train    # tokens/s per epoch, cached vs uncached hidden states
    python scripts/benchmark.py vocab data=...  # what a draft vocabulary (heads.vocab_size) costs the heads
    python scripts/benchmark.py rounding  # how often a multi-token bf16 pass picks another greedy token
    python scripts/benchmark.py loop heads=... tree=...  # the real decode loop against the timed verify step
    python scripts/benchmark.py vllm_k heads=...  # vLLM's num_speculative_tokens swept 0..heads, the fastest kept
    python scripts/benchmark.py tokenize  # the data's tokenisation: first run, cached run, peak memory

Extra ``key=value`` arguments are passed to the chosen benchmark.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHMARKS = {"loss": "bench_loss", "decode": "bench_decode", "train": "bench_train", "vocab": "bench_vocab",
              "rounding": "bench_rounding", "loop": "bench_loop",
              "vllm_k": "bench_vllm_k", "tokenize": "bench_tokenize"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    sys.path.insert(0, str(Path(__file__).parent))
    module = importlib.import_module(BENCHMARKS[argv[0]])
    overrides = dict(arg.split("=", 1) for arg in argv[1:])
    return module.main(**overrides) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
