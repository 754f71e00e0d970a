"""Capture the frozen backbone's hidden states once, for training heads on them (Medusa-1).

    python scripts/capture.py +recipe=medusa1 data=jsonl data.source=outputs/demo/distill.jsonl
    accelerate launch --num_processes 8 scripts/capture.py +recipe=medusa1 model.name_or_path=/models/llama-70b ...
    python scripts/capture.py +recipe=medusa1 model.device_map=auto ...   # one backbone over every GPU (+ CPU/disk)

Takes the training command's own keys: training with the same keys plus ``data.cache_hidden_states=true``
reads what this wrote (``<data.cache_dir>/<settings key>-{train,eval}/``: safetensors shards and
index.json). Each process writes its share of the shards; re-running the same command after a kill
keeps every finished shard and redoes a torn one. See medusa_train/data/capture/.
"""

from medusa_train.cli.capture import main

if __name__ == "__main__":
    main()
