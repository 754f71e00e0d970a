"""``medusa-train capture +recipe=medusa1|eagle3 ...``: the hidden-state capture stage on its own (several processes:
``accelerate launch [--num_processes N] -m medusa_train capture ...``), with the training command's own config
(so training with the same keys and ``data.cache_hidden_states=true`` finds what it wrote)."""

from __future__ import annotations

import time

from medusa_train.config.paths import CONFIG_DIR
from medusa_train.config.train import TrainConfig, build_config


def run(cfg: TrainConfig) -> dict:
    """Capture both splits (each process its share of the shards; finished ones kept); returns the train index."""
    from accelerate import Accelerator

    from medusa_train.data import capture
    from medusa_train.training import setup

    accelerator = Accelerator(mixed_precision=setup.mixed_precision(cfg))
    setup.check_processes(accelerator)
    if cfg.model.fsdp or setup.under_fsdp(accelerator):
        raise ValueError("capture does not shard the backbone (model.fsdp, accelerate's FSDP): capture a backbone "
                         "larger than one device with one process and model.device_map=auto, or launch with "
                         "configs/accelerate/ddp.yaml (each process a whole backbone)")
    if cfg.model.device_map == "auto" and accelerator.num_processes > 1:
        raise ValueError("model.device_map=auto spreads one backbone over every device: capture with one process "
                         "(medusa-train capture ...), or drop model.device_map to give each process a copy")
    started = time.perf_counter()
    backbone, tokenizer = setup.load_backbone_for(cfg, accelerator.device)
    backbone.eval()
    decoder = backbone.get_decoder()
    first = backbone.get_input_embeddings().weight.device  # device_map=auto: where the inputs go

    def hidden_fn(input_ids, attention_mask):
        return decoder(input_ids=input_ids.to(first), attention_mask=attention_mask.to(first)).last_hidden_state

    if cfg.method == "eagle3":  # +recipe=eagle3: the three states the draft reads and the final one
        from medusa_train.model.eagle3 import captured_states

        hidden_fn = captured_states(backbone, cfg.eagle3.aux_layer_ids)

    train, evals = setup.load_examples(cfg, tokenizer, accelerator)
    setup.capture_hidden_states(cfg, tokenizer, hidden_fn, accelerator, train, evals)
    folders = setup.capture_folders(cfg, setup.capture_settings(cfg, tokenizer, len(train), len(evals)))
    indexes = {split: capture.read_index(folder, key) for split, (folder, key) in folders.items()}
    if accelerator.is_main_process:
        seconds = time.perf_counter() - started
        for split, index in indexes.items():
            print(f"[medusa_train] {split}: {index['examples']} examples, {index['tokens']:,} tokens, "
                  f"{len(index['shards'])} shard(s), {index['bytes'] / 2**20:,.1f} MiB "
                  f"({index['bytes_per_token']:.0f} bytes per token) in {folders[split][0]}", flush=True)
        print(f"[medusa_train] capture done in {seconds:.0f} s; train on it with the same keys and "
              "data.cache_hidden_states=true", flush=True)
    accelerator.end_training()
    return indexes["train"]


def main() -> None:
    """Entry point of ``medusa-train capture``."""
    from medusa_train.cli.entry import run_command
    from medusa_train.cli.launch import relaunch_cpu_processes_if_asked

    relaunch_cpu_processes_if_asked()
    run_command("train", build_config, run, config_dir=CONFIG_DIR)
