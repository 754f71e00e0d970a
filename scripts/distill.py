"""Self-distilled training data: the backbone answers the training prompts itself.

    python scripts/distill.py                                    # 400 ShareGPT prompts, packaged model, greedy
    python scripts/distill.py num_prompts=1000 max_turns=1 batch_size=16 generation.max_new_tokens=256
    python scripts/distill.py model.name_or_path=/path/to/hf/folder source=/path/to/chat.jsonl \
        output=outputs/distill/mine.jsonl generation.temperature=0.7 generation.top_p=0.9

(``model=local`` of earlier versions is gone: the model section is a plain key here, so
``model.name_or_path=`` alone picks your own model; the other ``model.*`` keys keep their defaults.)

On a machine other jobs share, OMP_NUM_THREADS=1 is several times faster than 2 threads that
fight for the same cores (measured: 7x per decoding step with 3 jobs on 2 cores).

Writes ``<output>`` (messages jsonl for ``data.source=``), ``<output>.skipped.jsonl`` and
``<output>.stats.json``; re-running the same command continues an interrupted run.
See configs/commands/distill.yaml and medusa_train/config/distill.py.
"""

from medusa_train.cli.distill import main

if __name__ == "__main__":
    main()
