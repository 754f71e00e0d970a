"""What the medusa1 and medusa2 recipes share, as free functions (no recipe inherits from another).

A ``Run`` holds one training run's parts (config, accelerator, model, optimizer, schedule, data,
position); ``start_run`` builds it and resumes from the latest checkpoint, ``train_loop`` steps it
with the recipe's own ``micro_step`` and ``evaluate``, ``save_checkpoint`` writes where it is.

With several processes each rank reads its own shard of the batches, and the model goes through
``accelerator.prepare`` (DDP) inside ``OneBackward``: the head-by-head loss calls backward several
times per micro-batch, which DDP sees as one forward and one backward (``backward_step``); gradients
are averaged at the last micro-batch of each optimizer step.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import torch
from torch.utils.data import DataLoader

from medusa_train.backbone.processes import say
from medusa_train.config.train import TrainConfig, to_dict
from medusa_train.data.tokenize import IGNORE_INDEX
from medusa_train.training import checkpoint, resume, run_folder
from medusa_train.training.losses import LossResult, head_weights
from medusa_train.training.one_backward import OneBackward
from medusa_train.training.run_folder import RunFolder
from medusa_train.training.setup import TrainData
from medusa_train.training.shard import clip_gradients
from medusa_train.training.targets import HeadTargets
from medusa_train.training.usage import trained_line

R = TypeVar("R")


class MetricsLog:
    """Appends one JSON line per record to ``<output_dir>/metrics.jsonl`` (main process only) and to
    the trackers; ``extra()`` (if given) adds the recipe's own figures to every train record."""

    def __init__(self, output_dir: Path, accelerator, extra: Callable[[], dict] | None = None):
        self.path = RunFolder(Path(output_dir)).metrics
        self.accelerator = accelerator
        self.extra = extra

    def write(self, record: dict) -> None:
        if record.get("split", "train") == "train" and self.extra is not None:
            record = {**record, **self.extra()}
        if not self.accelerator.is_main_process:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        if self.accelerator.trackers and record.get("split") != "resume":  # a record of settings, not figures
            split = record.get("split", "train")
            self.accelerator.log({f"{split}/{k}": v for k, v in record.items() if k not in ("step", "split")},
                                 step=record["step"])


@dataclass
class Run:
    """One training run's parts and where it is (``step``, ``epoch``, ``micro_in_epoch``)."""

    cfg: TrainConfig
    accelerator: object
    model: object
    parameters: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: object
    data: TrainData
    metrics: MetricsLog
    total_steps: int
    wrapped: torch.nn.Module | None = None  #: the model as accelerate wrapped it (DDP), with several processes
    sharded: bool = False  #: the backbone's layers are sharded over the processes (FSDP2, ``shard.py``)
    step: int = 0
    epoch: int = 0
    micro_in_epoch: int = 0
    output_dir: Path = field(init=False)

    def __post_init__(self):
        self.output_dir = Path(self.cfg.trainer.output_dir)


def start_run(cfg: TrainConfig, accelerator, model, data: TrainData, param_groups: list[dict],
              metrics: MetricsLog, sharded: bool = False) -> Run:
    """AdamW over ``param_groups``, a warm-up + cosine schedule, and the run resumed from its latest
    checkpoint (``trainer.resume``); ``sharded``: the backbone's layers are sharded over the processes
    (``shard.py``), so every process must run as many backbone forwards."""
    o = cfg.optim
    optimizer = torch.optim.AdamW(param_groups, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    total = cfg.trainer.max_steps or cfg.trainer.epochs * data.steps_per_epoch
    warmup = o.warmup_steps if o.warmup_steps is not None else int(o.warmup_ratio * total)
    parameters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    run = Run(cfg, accelerator, model, parameters, optimizer, cosine_schedule(optimizer, warmup, total, o.min_lr_ratio),
              data, metrics, total, wrap(model, accelerator, sharded), sharded=sharded)
    restored = resume.restore(cfg, run.parameters, optimizer, run.scheduler, data.digest, total,
                              accelerator.num_processes)
    if restored is None:
        run_folder.set_aside_metrics(run.output_dir, accelerator.is_main_process)  # a fresh start: a fresh record
    else:
        path, state, rng = restored
        run.step, run.epoch, run.micro_in_epoch = state["step"], state["epoch"], state["micro_in_epoch"]
        if accelerator.process_index < len(rng):
            checkpoint.set_rng_state(rng[accelerator.process_index])
        say(accelerator, f"resumed from {path} at step {run.step} (epoch {run.epoch}, batch {run.micro_in_epoch})")
        if cfg.trainer.resume_new_settings:  # the record says so
            metrics.write({"step": run.step, "split": "resume", "checkpoint": str(path),
                           "changed": resume.changed_settings(cfg, path)})
        if accelerator.num_processes > 1:
            print(f"[medusa_train] rank {accelerator.process_index} resumed at step {run.step}", flush=True)
    n_train = sum(p.numel() for p in run.parameters.values())
    say(accelerator, f"{n_train / 1e6:.1f} M trainable parameters; {len(data.train)} train / {len(data.evals)} eval "
                     f"examples; {data.steps_per_epoch} steps per epoch; {total} steps in all; "
                     f"{accelerator.num_processes} process(es)")
    return run


def wrap(model, accelerator, sharded: bool = False) -> torch.nn.Module | None:
    """``OneBackward(model)`` through ``accelerator.prepare`` (DDP) when there are several processes; with a
    sharded backbone in a DDP of its own (the heads stay replicated; sharded LoRA weights are FSDP's)."""
    if accelerator.num_processes == 1:
        return None
    if sharded:  # under accelerate's FSDP, prepare would shard the heads too; the sharded layers are DTensors DDP ignores
        cuda = accelerator.device.type == "cuda"
        return torch.nn.parallel.DistributedDataParallel(OneBackward(model),
                                                         device_ids=[accelerator.device.index] if cuda else None)
    if not str(accelerator.distributed_type.value).startswith("MULTI_"):  # MULTI_GPU, _CPU, _XPU, ...: DDP
        raise ValueError(f"accelerate's {accelerator.distributed_type} is not supported by the training recipes yet: "
                         "launch with data parallelism (accelerate launch --config_file configs/accelerate/ddp.yaml), "
                         "and shard the backbone with configs/accelerate/fsdp.yaml (model.fsdp=true)")
    # placed already (and a backbone loaded without its layers keeps them on the meta device, which .to() refuses)
    return accelerator.prepare_model(OneBackward(model), device_placement=False)


def cosine_schedule(optimizer, warmup: int, total: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ------------------------------------------------------------------------------------ steps
def backward_step(run: Run, step: Callable[[], R]) -> R:
    """Run ``step()``, a micro-step that calls ``accelerator.backward`` one or more times; with several
    processes as one forward and backward of the wrapped model (``OneBackward``), which averages the
    gradients over processes at the last micro-batch of an optimizer step and keeps them local before."""
    if run.wrapped is None:
        return step()
    last = (run.micro_in_epoch + 1) % run.cfg.optim.grad_accum_steps == 0
    with contextlib.nullcontext() if last else run.wrapped.no_sync():  # DDP's own (accelerate's expects FSDP's under FSDP)
        surrogate, result = run.wrapped(step)
        surrogate.backward()
    return result


def hidden_states(run: Run, batch: dict, grad: bool = False) -> torch.Tensor:
    """The backbone's final hidden states for ``batch`` (read from the batch when they were captured)."""
    if "hidden" in batch:
        return batch["hidden"]
    with torch.set_grad_enabled(grad), run.accelerator.autocast():
        return run.model(batch["input_ids"], attention_mask=batch["attention_mask"]).hidden_states


def epoch_batches(run: Run, epoch: int) -> list[list[int]]:
    """This rank's batches for ``epoch``: every rank sees a different, equally long shard."""
    acc, sampler = run.accelerator, run.data.train_sampler
    sampler.set_epoch(epoch)
    shard = list(sampler)[acc.process_index::acc.num_processes][: run.data.batches_per_rank]
    if acc.num_processes > 1 and epoch == run.epoch:
        print(f"[medusa_train] rank {acc.process_index} first batch of epoch {epoch}: {shard[0]}", flush=True)
    return shard


def train_loop(run: Run, micro_step: Callable[[dict, float], LossResult], evaluate: Callable[[], dict],
               on_step: Callable[[], None] | None = None) -> dict:
    """Step ``run`` to ``total_steps``: micro-batches, optimizer steps, metrics, evals, checkpoints.

    Args:
        run: The run (from ``start_run``), possibly resumed mid-epoch.
        micro_step: ``(batch, loss_scale) -> LossResult``: forward and backward of one micro-batch.
        evaluate: Writes and returns an eval record.
        on_step: Called after each optimizer step (e.g. the recipe's own per-step figures).

    Returns:
        The last eval record (empty without eval examples).
    """
    from tqdm.auto import tqdm

    cfg, acc, accum = run.cfg, run.accelerator, run.cfg.optim.grad_accum_steps
    last_eval = evaluate() if run.step == 0 and run.data.evals else None
    bar = tqdm(total=run.total_steps, initial=run.step, desc="train", unit="step", disable=not acc.is_main_process,
               dynamic_ncols=True)
    window: list[LossResult] = []
    tokens, started = 0, time.perf_counter()
    first_step, loop_started = run.step, started
    while run.step < run.total_steps:
        # whole accumulation groups only; a checkpoint stores how far into the epoch we were
        batches = epoch_batches(run, run.epoch)[run.micro_in_epoch:run.data.steps_per_epoch * accum]
        # own generator: a DataLoader iterator otherwise draws from the global RNG (a resumed run: other dropout masks)
        loader = DataLoader(run.data.train, batch_sampler=batches, collate_fn=run.data.collator,
                            generator=torch.Generator())
        for batch in loader:
            window.append(micro_step(batch, 1.0 / accum))
            tokens += int(batch["attention_mask"].sum())
            run.micro_in_epoch += 1
            if run.micro_in_epoch % accum:
                continue
            optimizer_step(run)
            if on_step is not None:
                on_step()
            run.step += 1
            merged, stepped, window = merge(window), window, []
            bar.update(1)
            bar.set_postfix(loss=f"{merged['loss']:.3f}", head1_top1=f"{merged.get('head1/top1', 0):.3f}")
            if run.step % cfg.trainer.log_every == 0 or run.step == run.total_steps:
                if acc.num_processes > 1:  # the step's figures over every process's micro-batches, not rank 0's
                    from accelerate.utils import gather_object

                    merged = merge(gather_object([replace(r, loss=r.loss.detach().cpu()) for r in stepped]))
                elapsed = time.perf_counter() - started
                run.metrics.write({"step": run.step, "split": "train", "epoch": run.epoch,
                                   "lr": run.scheduler.get_last_lr()[0],
                                   "tokens_per_s": tokens * acc.num_processes / max(elapsed, 1e-9), **merged})
                tokens, started = 0, time.perf_counter()
            if cfg.trainer.eval_every and run.step % cfg.trainer.eval_every == 0 and run.data.evals:
                last_eval = evaluate()
            if cfg.trainer.save_every and run.step % cfg.trainer.save_every == 0:
                save_checkpoint(run)
            if run.step >= run.total_steps:
                break
        else:
            run.epoch, run.micro_in_epoch = run.epoch + 1, 0
    bar.close()
    if run.step > first_step:
        say(acc, trained_line(first_step + 1, run.step, time.perf_counter() - loop_started))
    check_ranks_agree(run)
    if run.data.evals and (not cfg.trainer.eval_every or run.step % cfg.trainer.eval_every):
        last_eval = evaluate()
    if not cfg.trainer.save_every or run.step % cfg.trainer.save_every:
        save_checkpoint(run)
    return last_eval or {}


def optimizer_step(run: Run) -> None:
    """Clip, step, schedule, zero (DDP averaged the gradients in the last micro-batch's backward)."""
    params = list(run.parameters.values())
    if run.cfg.optim.max_grad_norm:
        clip_gradients(params, run.cfg.optim.max_grad_norm)  # (sharded LoRA gradients counted whole)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)


def merge(results: list[LossResult]) -> dict:
    """Average the metrics of the micro-batches of one optimizer step (weighted by token counts)."""
    merged: dict[str, float] = {"loss": sum(float(r.loss) for r in results) / len(results)}
    for k in range(len(results[0].per_head)):
        n = sum(r.per_head[k].count for r in results) or 1
        for name in ("loss", "top1", "top5"):
            merged[f"head{k + 1}/{name}"] = sum(getattr(r.per_head[k], name) * r.per_head[k].count
                                                for r in results) / n
    return merged


# ------------------------------------------------------------------------------------ eval
class HeadEvalSums:
    """Per-head sums over the held-out batches, reduced over processes into one eval record."""

    def __init__(self, num_heads: int):
        self.sums = torch.zeros(num_heads, 5, dtype=torch.float64)  # loss*n, top1*n, top5*n, n, text targets
        self.kept = False  # the targets keep only a share of the text's (greedy)

    def add(self, result: LossResult, targets: HeadTargets | None = None) -> None:
        text = targets.text_counts() if targets is not None else None
        self.kept |= text is not None
        text = text or [0] * len(result.per_head)
        for k, h in enumerate(result.per_head):
            self.sums[k] += torch.tensor([h.loss * h.count, h.top1 * h.count, h.top5 * h.count, h.count, text[k]],
                                         dtype=torch.float64)

    def record(self, run: Run) -> dict:
        """``{"step", "split": "eval", "loss", "head{k}/loss|top1|top5"[, "head{k}/kept"]}`` over every process."""
        acc = run.accelerator
        sums = self.sums if acc.num_processes == 1 else acc.reduce(self.sums.to(acc.device), reduction="sum").cpu()
        weights = head_weights(sums.shape[0], run.cfg.loss.head_decay)
        record, total = {"step": run.step, "split": "eval"}, 0.0
        for k in range(sums.shape[0]):
            n = max(sums[k, 3].item(), 1.0)
            record.update({f"head{k + 1}/loss": sums[k, 0].item() / n, f"head{k + 1}/top1": sums[k, 1].item() / n,
                           f"head{k + 1}/top5": sums[k, 2].item() / n})
            if self.kept:  # share of the text's targets these targets keep
                record[f"head{k + 1}/kept"] = sums[k, 3].item() / max(sums[k, 4].item(), 1.0)
            total += weights[k] * sums[k, 0].item() / n
        record["loss"] = total
        if self.kept and sums[0, 3] == 0 and sums[0, 4] > 0:
            raise ValueError(
                "loss.targets=greedy: the held-out text never agrees with the backbone's own greedy choices, so "
                "no head has a target. Train on text this backbone wrote (medusa-train distill), or use loss.targets=text")
        return record


def eval_batches(run: Run):
    """This rank's held-out batches, on the device. With a sharded backbone every rank runs as many: a rank
    with fewer repeats a batch with every label ignored (it adds nothing to the sums)."""
    acc = run.accelerator
    every = list(run.data.eval_sampler)
    batches = every[acc.process_index::acc.num_processes]
    padding = -(-len(every) // acc.num_processes) - len(batches) if run.sharded else 0
    loader = DataLoader(run.data.evals, batch_sampler=batches + every[:1] * padding, collate_fn=run.data.collator)
    for i, batch in enumerate(loader):
        ignored = i >= len(batches)
        yield {k: (torch.full_like(v, IGNORE_INDEX) if ignored and k == "labels" else v).to(acc.device)
               for k, v in batch.items()}


def top1_summary(record: dict, num_heads: int) -> str:
    return " ".join(f"{record[f'head{k + 1}/top1']:.3f}" for k in range(num_heads))


# ------------------------------------------------------------------------------------ save
def check_ranks_agree(run: Run) -> None:
    """After training, every process must hold the same weights (same averaged gradients)."""
    acc = run.accelerator
    if acc.num_processes == 1:
        return
    from medusa_train.training.shard import full

    checksum = torch.stack([full(p.detach()).double().sum() for p in run.parameters.values()]).sum().view(1)
    sums = acc.gather(checksum.to(acc.device)).cpu()
    if not torch.allclose(sums, sums[0].expand_as(sums), rtol=1e-9, atol=0):
        raise RuntimeError(f"trainable weights diverged across processes: {sums.tolist()}")
    say(acc, f"heads identical on all {acc.num_processes} processes")


def save_checkpoint(run: Run) -> None:
    """Trainable weights, optimizer, schedule, every rank's RNG and the data position, atomically; sharded weights
    and their optimizer state gathered whole first (every process takes part; process 0 writes)."""
    from medusa_train.training.shard import is_sharded

    acc = run.accelerator
    weights, optimizer_state = dict(run.parameters), None
    if any(is_sharded(p) for p in run.parameters.values()):
        weights, optimizer_state = checkpoint.full_state(run.parameters, run.optimizer)
    rng = [checkpoint.rng_state()]
    if acc.num_processes > 1:
        from accelerate.utils import gather_object

        rng = gather_object(rng)
    if acc.is_main_process:
        path = checkpoint.save_checkpoint(run.output_dir, run.step, weights, run.optimizer, run.scheduler,
                                          {"epoch": run.epoch, "micro_in_epoch": run.micro_in_epoch,
                                           "num_processes": acc.num_processes, "data": run.data.digest}, rng,
                                          run.cfg.trainer.keep_last, config=to_dict(run.cfg),
                                          optimizer_state=optimizer_state)
        say(acc, f"checkpoint: {path}")
    acc.wait_for_everyone()


def finish(run: Run) -> None:
    """End the run: free the DDP wrapper while the process group is still registered, then let accelerate stop the
    trackers and destroy the group.

    The other order deadlocks now and then (a 2-process gloo run hung so in CI and once in a local test run):
    DDP's C++ reducer holds the gloo group, and when freeing the reducer drops the group's last reference, the
    group's destructor joins its worker threads while holding the GIL, and a worker still releasing its last
    collective's tensors waits for the GIL (pytorch/pytorch#56297). Freed first, the reducer only lets go of a
    reference; the group is then destroyed through ``destroy_process_group``, which releases the GIL."""
    wrapped = weakref.ref(run.wrapped) if run.wrapped is not None else None
    run.wrapped = None
    run.accelerator.free_memory()  # accelerate's own references to what it prepared, then a garbage collection
    if wrapped is not None and wrapped() is not None:
        say(run.accelerator, "warning: the DDP wrapper is still referenced at the end of the run; the process group "
                             "may hang at exit")
    run.accelerator.end_training()


def write_training_config(cfg: TrainConfig, folder: Path) -> None:
    """The run's ``training_config.json`` into ``folder`` (its export being written; ``run_folder``)."""
    run_folder.write_training_config(to_dict(cfg), folder)
