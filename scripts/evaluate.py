"""Evaluate Medusa heads on MT-Bench (or any prompt file) against plain decoding.

    python scripts/evaluate.py draft=outputs/medusa1/export
    python scripts/evaluate.py draft=outputs/medusa1/export bench.limit=5 generation.max_new_tokens=64
    python scripts/evaluate.py draft=outputs/medusa1/export tree=outputs/trees/medusa1-n64.yaml model.dtype=bfloat16

Writes report.json, report.md and report.png to ``output_dir`` (default outputs/eval/<heads name>)
and prints ``mean accepted length: X.XX`` and ``speedup: Y.YYx`` last. Keys: configs/commands/evaluate.yaml.
"""

from medusa_train.cli.evaluate import main

if __name__ == "__main__":
    main()
