"""What a recipe builds before it trains, as free functions: the accelerator, the backbone, the heads, the data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_train.backbone.load import load_backbone_for
from medusa_train.backbone.processes import autocast_precision, check_processes, say, under_fsdp
from medusa_train.config.capture import capture_view
from medusa_train.config.train import TrainConfig, fsdp_problems, to_dict


def mixed_precision(cfg: TrainConfig) -> str:
    """``trainer.mixed_precision``, with fp16 read as bf16 without a GPU (fp16 autocast needs one)."""
    return autocast_precision(cfg.trainer.mixed_precision)


def make_accelerator(cfg: TrainConfig):
    """An ``Accelerator`` for ``cfg`` (mixed precision, W&B when ``logger`` is set), seeded, its output folder made."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    output_dir = Path(cfg.trainer.output_dir)
    mixed = mixed_precision(cfg)
    use_wandb = cfg.logger is not None
    accelerator = Accelerator(mixed_precision=mixed, log_with="wandb" if use_wandb else None,
                              project_dir=str(output_dir))
    check_processes(accelerator)
    if cfg.model.device_map == "auto" and accelerator.num_processes > 1:
        raise ValueError("model.device_map=auto spreads one backbone over every device, which data parallelism "
                         "cannot wrap: drop it for training (each process then holds the backbone), or capture "
                         "with one process (medusa-train capture ... model.device_map=auto)")
    if under_fsdp(accelerator) and (problems := fsdp_problems(cfg, fsdp=True)):
        raise ValueError("\n".join(problems))
    output_dir.mkdir(parents=True, exist_ok=True)
    set_seed(cfg.trainer.seed)
    if use_wandb:
        accelerator.init_trackers(cfg.logger.project, config=to_dict(cfg), init_kwargs={"wandb": {
            "dir": str(output_dir), "name": cfg.logger.name, "entity": cfg.logger.entity, "tags": cfg.logger.tags}})
    return accelerator


def shards_backbone(cfg: TrainConfig, accelerator) -> bool:
    """Whether the backbone's layers are sharded over the processes (``shard.py``; Medusa-2: the 4-bit layers
    with their LoRA): ``model.fsdp=true`` or a launch under accelerate's FSDP, with more than one process."""
    return (cfg.model.fsdp or under_fsdp(accelerator)) and accelerator.num_processes > 1


def load_backbone_on_first_process(cfg: TrainConfig, accelerator, pad_token_id: int | None):
    """Process 0: the backbone read whole into CPU memory; the others: its modules without weights, to receive
    them from process 0 while sharding (``shard.shard_backbone``)."""
    if accelerator.process_index == 0:
        return load_backbone_for(cfg.model, torch.device("cpu"))[0]
    from medusa_train.backbone.without_layers import empty_backbone

    m = cfg.model
    return empty_backbone(m.name_or_path, m.dtype, m.trust_remote_code, m.attn_implementation, pad_token_id)


def load_without_layers_for(cfg: TrainConfig, accelerator):
    """The backbone without its decoder layers on the device (what the heads read), or ``None`` when its
    checkpoint does not name its tensors as the model does (then load it whole)."""
    from medusa_train.backbone.without_layers import load_without_layers

    m = cfg.model
    backbone = load_without_layers(m.name_or_path, m.dtype, accelerator.device, m.trust_remote_code)
    if backbone is None:
        say(accelerator, f"model.name_or_path={m.name_or_path}: its checkpoint does not name the tensors outside its "
                         "layers as the model does; loading it whole")
    else:
        held = sum(p.numel() for p in backbone.parameters() if not p.is_meta)
        say(accelerator, f"hidden states already captured: backbone loaded without its decoder layers ({held:,} of "
                         f"{sum(p.numel() for p in backbone.parameters()):,} parameters: embeddings, norm, LM head)")
    return backbone


@dataclass
class TrainData:
    """The examples (token ids and labels, or cached hidden states), their batching, and the step counts."""

    train: list[dict]
    evals: list[dict]
    collator: Callable
    train_sampler: object
    eval_sampler: object
    batches_per_rank: int
    steps_per_epoch: int
    digest: str = ""  #: of the examples' token ids and labels (``examples_digest``): a checkpoint keeps it


def examples_digest(train: list[dict], evals: list[dict]) -> str:
    """A digest of the tokenised examples (train, then eval: ids and labels in order): a resumed run must see the
    same ones (``resume.py``), whatever changed in the data file or its reading."""
    import hashlib

    import numpy as np

    digest = hashlib.sha256()
    for split in (train, evals):
        digest.update(str(len(split)).encode())
        for example in split:
            for key in ("input_ids", "labels"):
                digest.update(np.asarray(example[key], dtype=np.int64).tobytes() + b"|")
    return digest.hexdigest()[:24]


def build_data(cfg: TrainConfig, tokenizer, model, accelerator, train: list[dict], evals: list[dict],
               states_fn=None) -> TrainData:
    """Length-grouped batches of the tokenised examples (``load_examples``); with ``data.cache_hidden_states``
    of the frozen backbone's states instead (``states_fn(input_ids, attention_mask, start=None)``: what to
    capture; by default what the method's family captures of ``model.backbone``)."""
    from medusa_train.data import LengthGroupedBatchSampler, PaddingCollator, example_lengths

    d = cfg.data
    collator = PaddingCollator(tokenizer.pad_token_id)
    digest = examples_digest(train, evals)  # of the examples themselves, before any states are captured
    if d.cache_hidden_states:
        from medusa_train.data.capture.run import capture_hidden_states
        from medusa_train.model.family import captured_for

        captured = captured_for(cfg)
        train, evals, collator = capture_hidden_states(capture_view(cfg), captured, tokenizer,
                                                       states_fn or captured.states(model.backbone), accelerator,
                                                       train, evals)
    train_sampler = LengthGroupedBatchSampler(example_lengths(train), d.batch_size, seed=d.seed, shuffle=True)
    eval_sampler = LengthGroupedBatchSampler(example_lengths(evals), d.eval_batch_size or d.batch_size,
                                             seed=d.seed, shuffle=False)
    world = accelerator.num_processes
    per_rank = len(train_sampler) // world
    if per_rank < 1:
        raise ValueError(f"{len(train)} training examples make fewer batches than processes ({world}); "
                         "lower data.batch_size or raise data.max_samples")
    steps = per_rank // cfg.optim.grad_accum_steps
    if steps < 1:
        raise ValueError(f"{per_rank} batches per process make no full optimizer step with "
                         f"optim.grad_accum_steps={cfg.optim.grad_accum_steps}; lower it")
    return TrainData(train, evals, collator, train_sampler, eval_sampler, per_rank, steps, digest)


