"""One run over several launched processes (``accelerate launch``): saying things once, refusing a launch that
made each process a run of its own, and telling whether accelerate's FSDP holds the backbone."""

from __future__ import annotations

import os


def say(accelerator, message: str) -> None:
    """Print ``[medusa_train] message`` once (main process)."""
    if accelerator.is_main_process:
        print(f"[medusa_train] {message}", flush=True)


def check_processes(accelerator) -> None:
    """Several launched processes must be one run: accelerate's FSDP without a GPU starts each on its own."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes == 1:
        raise ValueError(f"{launched} processes were launched but accelerate made each a run of its own "
                         f"({accelerator.distributed_type.value}): its FSDP runs only on GPUs. Without one, launch "
                         "with --cpu (configs/accelerate/ddp.yaml) and model.fsdp=true to shard the backbone")


def under_fsdp(accelerator) -> bool:
    return accelerator.distributed_type.value == "FSDP"


def autocast_precision(mixed: str) -> str:
    """``trainer.mixed_precision`` (``no``, ``bfloat16``, ``float16``) as accelerate names it here (``no``, ``bf16``,
    ``fp16``): float16 read as bfloat16 without a GPU (fp16 autocast needs one)."""
    import torch

    if mixed == "float16" and not torch.cuda.is_available():
        mixed = "bfloat16"
    return {"bfloat16": "bf16", "float16": "fp16"}.get(mixed, mixed)
