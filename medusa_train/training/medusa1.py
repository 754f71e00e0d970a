"""The training recipe: setup -> train -> save_checkpoint -> cleanup.

    accelerate launch train.py +recipe=medusa1                 # frozen backbone, heads train
    accelerate launch train.py +recipe=medusa1 trainer=smoke   # a few steps, minutes on CPU
    python train.py +recipe=medusa1 heads.num_heads=5 optim.lr=5e-4

The loss is computed head by head (see ``losses.py``), which calls backward several times
per micro-batch. DDP's hooks expect one backward per forward, so the model is not wrapped:
each rank reads its own shard of the batches and gradients of the trainable parameters are
averaged with one all-reduce before the optimizer step, which is what DDP computes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from medusa_train.training import checkpoint
from medusa_train.config.paths import CONFIG_DIR
from medusa_train.config.train import TrainConfig, build_config, to_dict
from medusa_train.model.layouts import MEDUSA_PARAMETERS
from medusa_train.training.losses import IGNORE_INDEX, LossResult, Teacher, head_targets, medusa_loss_backward, next_token_inputs



class MetricsLog:
    """Appends one JSON line per record to ``<output_dir>/metrics.jsonl`` (main process only)."""

    def __init__(self, output_dir: Path, accelerator):
        self.path = output_dir / "metrics.jsonl"
        self.accelerator = accelerator

    def write(self, record: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        if self.accelerator.trackers:
            split = record.get("split", "train")
            self.accelerator.log({f"{split}/{k}": v for k, v in record.items() if k not in ("step", "split")},
                                 step=record["step"])


class Medusa1Recipe:
    """Medusa-1: a frozen backbone; only the heads train."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.output_dir = Path(cfg.trainer.output_dir)

    # ------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        cfg = self.cfg
        use_wandb = cfg.logger is not None
        mixed = cfg.trainer.mixed_precision
        if mixed == "fp16" and not torch.cuda.is_available():
            mixed = "bf16"  # fp16 autocast needs a GPU; bf16 is the CPU equivalent
        self.accelerator = Accelerator(mixed_precision=mixed, log_with="wandb" if use_wandb else None,
                                       project_dir=str(self.output_dir))
        acc = self.accelerator
        self.output_dir.mkdir(parents=True, exist_ok=True)
        set_seed(cfg.trainer.seed)
        self.metrics = MetricsLog(self.output_dir, acc)
        if use_wandb:
            acc.init_trackers(cfg.logger.project, config=to_dict(cfg), init_kwargs={"wandb": {
                "dir": str(self.output_dir), "name": cfg.logger.name, "entity": cfg.logger.entity,
                "tags": cfg.logger.tags}})

        self.model, self.tokenizer = self.build_model()
        self.parameters = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.build_data()
        self.optimizer = torch.optim.AdamW(self.param_groups(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                           weight_decay=cfg.optim.weight_decay)
        self.total_steps = cfg.trainer.max_steps or cfg.trainer.epochs * self.steps_per_epoch
        warmup = cfg.optim.warmup_steps
        if warmup is None:
            warmup = int(cfg.optim.warmup_ratio * self.total_steps)
        self.scheduler = _cosine_schedule(self.optimizer, warmup, self.total_steps, cfg.optim.min_lr_ratio)
        self.step, self.epoch, self.micro_in_epoch = 0, 0, 0
        self.maybe_resume()
        n_train = sum(p.numel() for p in self.parameters.values())
        self.log(f"{n_train / 1e6:.1f} M trainable parameters; {len(self.train_examples)} train / "
                 f"{len(self.eval_examples)} eval examples; {self.steps_per_epoch} steps per epoch; "
                 f"{self.total_steps} steps in all; {acc.num_processes} process(es)")

    def build_model(self):
        from medusa_train.backbone.load import load_backbone

        m = self.cfg.model
        backbone, tokenizer = load_backbone(
            m.name_or_path, dtype=m.dtype, quantization=m.quantization, trust_remote_code=m.trust_remote_code,
            attn_implementation=m.attn_implementation, bnb_compute_dtype=m.bnb_compute_dtype,
            bnb_double_quant=m.bnb_double_quant, device_map={"": self.accelerator.device} if m.quantization else None)
        if not m.quantization:  # a quantized model is placed by device_map at load time
            backbone.to(self.accelerator.device)
        return self.build_heads(backbone), tokenizer

    def build_heads(self, backbone):
        """Float32 trainable heads on ``backbone``: fresh, or from ``heads.init_from``."""
        from medusa_train.model.medusa import MedusaModel

        m, h = self.cfg.model, self.cfg.heads
        if h.init_from:
            model = MedusaModel.from_pretrained(h.init_from, backbone=backbone)
            c = model.config
            shape = (c.num_heads, c.num_layers, c.next_token_input, c.path_input, c.prefix_attention)
            if shape != (h.num_heads, h.num_layers, h.next_token_input, h.path_input, h.prefix_attention):
                raise ValueError(f"heads.init_from={h.init_from} has {c.num_heads} heads x {c.num_layers} layers, "
                                 f"next_token_input={str(c.next_token_input).lower()}, "
                                 f"path_input={str(c.path_input).lower()}, "
                                 f"prefix_attention={str(c.prefix_attention).lower()}; set heads.num_heads, "
                                 "heads.num_layers, heads.next_token_input, heads.path_input and "
                                 "heads.prefix_attention to match")
            for part in model.medusa_modules():
                part.float()
            model.config.dtype = "float32"
            model.config.base_model_name_or_path = str(m.name_or_path)
        else:
            model = MedusaModel.from_backbone(backbone, h.num_heads, h.num_layers, h.share_lm_head, dtype="float32",
                                              next_token_input=h.next_token_input, path_input=h.path_input,
                                              prefix_attention=h.prefix_attention)
        for part in model.medusa_modules():
            part.requires_grad_(True)
            part.to(self.accelerator.device)
        return model

    def param_groups(self) -> list[dict]:
        return [{"params": list(self.parameters.values()), "lr": self.cfg.optim.lr}]

    def build_data(self) -> None:
        from medusa_train.data import LengthGroupedBatchSampler, MedusaCollator, build_datasets

        d, acc = self.cfg.data, self.accelerator
        with acc.main_process_first():  # the first process fills the data caches; the others read them
            train, evals, stats = build_datasets(self.tokenizer, d.source, d.max_length, d.max_samples,
                                                 d.eval_size, d.seed)
        self.log(f"data: {stats.summary()}")
        if not train:
            raise ValueError(f"data.source={d.source}: no usable training conversation ({stats.summary()})")
        self.collator = MedusaCollator(self.tokenizer.pad_token_id)
        if d.cache_hidden_states:
            train, evals = self.cache_hidden_states(train, evals)
        self.train_examples, self.eval_examples = train, evals
        self.train_sampler = LengthGroupedBatchSampler([len(e["input_ids"]) for e in train], d.batch_size,
                                                       seed=d.seed, shuffle=True)
        self.eval_sampler = LengthGroupedBatchSampler([len(e["input_ids"]) for e in evals],
                                                      d.eval_batch_size or d.batch_size, seed=d.seed, shuffle=False)
        world = acc.num_processes
        self.batches_per_rank = len(self.train_sampler) // world
        if self.batches_per_rank < 1:
            raise ValueError(f"{len(train)} training examples make fewer batches than processes ({world}); "
                             "lower data.batch_size or raise data.max_samples")
        self.steps_per_epoch = self.batches_per_rank // self.cfg.optim.grad_accum_steps
        if self.steps_per_epoch < 1:
            raise ValueError(f"{self.batches_per_rank} batches per process make no full optimizer step with "
                             f"optim.grad_accum_steps={self.cfg.optim.grad_accum_steps}; lower it")

    def cache_hidden_states(self, train: list[dict], evals: list[dict]) -> tuple[list[dict], list[dict]]:
        """Run the frozen backbone once over both splits; later epochs (and runs) read the cache."""
        from medusa_train.data import capture as hidden_cache

        d, m, acc = self.cfg.data, self.cfg.model, self.accelerator
        # the whole model section: quantization and its settings change the states as much as the weights do
        key = hidden_cache.cache_key(model=m.name_or_path, model_section=json.dumps(asdict(m), sort_keys=True),
                                     source=d.source, max_samples=d.max_samples, max_length=d.max_length,
                                     eval_size=d.eval_size, seed=d.seed, tokenizer=self.tokenizer.name_or_path,
                                     n_train=len(train), n_eval=len(evals))
        root = Path(d.cache_dir) if d.cache_dir else hidden_cache.default_cache_root()
        loaded = []
        for split, examples in (("train", train), ("eval", evals)):
            folder = root / f"{key}-{split}"
            with acc.main_process_first():
                if acc.is_main_process:
                    with self.accelerator.autocast():
                        hidden_cache.build_hidden_cache(self.model, examples, folder, d.batch_size * 2, acc.device,
                                                        desc=f"caching {split} hidden states")
            loaded.append(hidden_cache.load_hidden_cache(folder))
            self.log(f"hidden states of {len(examples)} {split} examples cached in {folder}")
        self.collator = hidden_cache.HiddenCollator()
        return loaded[0], loaded[1]

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches for ``epoch``: every rank sees a different, equally long shard."""
        self.train_sampler.set_epoch(epoch)
        acc = self.accelerator
        shard = list(self.train_sampler)[acc.process_index::acc.num_processes][: self.batches_per_rank]
        if acc.num_processes > 1 and epoch == self.epoch:
            print(f"[medusa_train] rank {acc.process_index} first batch of epoch {epoch}: {shard[0]}", flush=True)
        return shard

    def maybe_resume(self) -> None:
        resume = self.cfg.trainer.resume
        path = None if resume == "never" else (checkpoint.latest_checkpoint(self.output_dir) if resume == "auto"
                                               else Path(resume))
        if path is None:
            return
        state, rng = checkpoint.load_checkpoint(path, self.parameters, self.optimizer, self.scheduler)
        self.step, self.epoch, self.micro_in_epoch = state["step"], state["epoch"], state["micro_in_epoch"]
        rank = self.accelerator.process_index
        if rank < len(rng):
            checkpoint.set_rng_state(rng[rank])
        self.log(f"resumed from {path} at step {self.step} (epoch {self.epoch}, batch {self.micro_in_epoch})")

    # ------------------------------------------------------------------------------------ train
    def train(self) -> dict:
        from tqdm.auto import tqdm

        cfg, acc = self.cfg, self.accelerator
        accum = cfg.optim.grad_accum_steps
        last_eval = self.evaluate() if self.step == 0 and self.eval_examples else None
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step",
                   disable=not acc.is_main_process, dynamic_ncols=True)
        window: list[LossResult] = []
        tokens, started = 0, time.perf_counter()
        while self.step < self.total_steps:
            # whole accumulation groups only; a checkpoint stores how far into the epoch we were
            batches = self.epoch_batches(self.epoch)[self.micro_in_epoch:self.steps_per_epoch * accum]
            # own generator: a DataLoader iterator otherwise draws from the global RNG, so a resumed run
            # (one extra iterator) would see different dropout masks from an uninterrupted one
            loader = DataLoader(self.train_examples, batch_sampler=batches, collate_fn=self.collator,
                                generator=torch.Generator())
            for batch in loader:
                result = self.micro_step(batch, loss_scale=1.0 / accum)
                window.append(result)
                tokens += int(batch["attention_mask"].sum())
                self.micro_in_epoch += 1
                if self.micro_in_epoch % accum:
                    continue
                self.optimizer_step()
                self.step += 1
                merged = _merge(window)
                window = []
                bar.update(1)
                bar.set_postfix(loss=f"{merged['loss']:.3f}", head1_top1=f"{merged.get('head1/top1', 0):.3f}")
                if self.step % cfg.trainer.log_every == 0 or self.step == self.total_steps:
                    elapsed = time.perf_counter() - started
                    self.metrics.write({"step": self.step, "split": "train", "epoch": self.epoch,
                                        "lr": self.scheduler.get_last_lr()[0],
                                        "tokens_per_s": tokens * acc.num_processes / max(elapsed, 1e-9), **merged})
                    tokens, started = 0, time.perf_counter()
                if cfg.trainer.eval_every and self.step % cfg.trainer.eval_every == 0 and self.eval_examples:
                    last_eval = self.evaluate()
                if cfg.trainer.save_every and self.step % cfg.trainer.save_every == 0:
                    self.save_checkpoint()
                if self.step >= self.total_steps:
                    break
            else:
                self.epoch, self.micro_in_epoch = self.epoch + 1, 0
        bar.close()
        self.check_ranks_agree()
        if self.eval_examples and (not cfg.trainer.eval_every or self.step % cfg.trainer.eval_every):
            last_eval = self.evaluate()
        if not cfg.trainer.save_every or self.step % cfg.trainer.save_every:
            self.save_checkpoint()
        return last_eval or {}

    @property
    def backbone_trains(self) -> bool:
        return any(not name.startswith(MEDUSA_PARAMETERS) for name in self.parameters)

    def hidden_states(self, batch: dict) -> torch.Tensor:
        if "hidden" in batch:  # from the hidden-state cache
            return batch["hidden"]
        with torch.set_grad_enabled(self.backbone_trains), self.accelerator.autocast():
            return self.model(batch["input_ids"], attention_mask=batch["attention_mask"]).hidden_states

    def head_inputs(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """``(what the heads read, the loss's target arguments)``.

        ``loss.targets=greedy`` needs the backbone's greedy next token at every position (no grad):
        ``{"predictions": ...}``. ``loss.targets=teacher`` passes ``{"teacher": Teacher(...)}``, the
        backbone's distributions read from ``hidden`` (detached) chunk by chunk. Heads that read the
        next token (``heads.next_token_input``) get the text's, and the greedy choice only where there
        is no trained text (``losses.next_token_inputs``): from the predictions when they exist, else
        from the LM head on those few positions.
        """
        targets = self.cfg.loss.targets
        predictions = self.model.next_tokens(hidden) if targets == "greedy" else None
        loss_targets = {}
        if predictions is not None:
            loss_targets["predictions"] = predictions
        elif targets == "teacher":
            loss_targets["teacher"] = Teacher(self.model.base_logits, hidden.detach())
        context = self.model.context(hidden)  # through the prefix attention layer, if any
        if not self.model.config.next_token_input:
            return context, loss_targets
        greedy = (lambda mask: predictions[mask]) if predictions is not None else \
            (lambda mask: self.model.next_tokens(hidden[mask]))
        tokens = next_token_inputs(labels, self.model.num_heads, greedy)
        return self.model.head_inputs(context, tokens), loss_targets

    def micro_step(self, batch: dict, loss_scale: float) -> LossResult:
        batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
        hidden = self.hidden_states(batch)
        with self.accelerator.autocast():
            inputs, loss_targets = self.head_inputs(hidden, batch["labels"])
            return medusa_loss_backward(self.model.head_logits, inputs, batch["labels"], self.model.num_heads,
                                        head_decay=self.cfg.loss.head_decay, chunk_size=self.cfg.loss.chunk_size,
                                        backward=self.accelerator.backward, loss_scale=loss_scale, **loss_targets)

    def optimizer_step(self) -> None:
        params = list(self.parameters.values())
        _average_gradients(params, self.accelerator)
        if self.cfg.optim.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss and top-1/top-5 per head on this rank's share of the held-out split, averaged over ranks."""
        acc = self.accelerator
        batches = list(self.eval_sampler)[acc.process_index::acc.num_processes]
        k_heads, greedy = self.model.num_heads, self.cfg.loss.targets == "greedy"
        sums = torch.zeros(k_heads, 5, dtype=torch.float64)  # loss*n, top1*n, top5*n, n, text targets (greedy)
        for batch in DataLoader(self.eval_examples, batch_sampler=batches, collate_fn=self.collator):
            batch = {k: v.to(acc.device) for k, v in batch.items()}
            hidden = self.hidden_states(batch)
            with acc.autocast():
                inputs, loss_targets = self.head_inputs(hidden, batch["labels"])
                result = medusa_loss_backward(self.model.head_logits, inputs, batch["labels"], k_heads,
                                              head_decay=self.cfg.loss.head_decay,
                                              chunk_size=self.cfg.loss.chunk_size, backward=None, **loss_targets)
            text = (head_targets(batch["labels"], k_heads) != IGNORE_INDEX).sum(dim=(1, 2)).tolist() if greedy \
                else [0] * k_heads
            for k, h in enumerate(result.per_head):
                sums[k] += torch.tensor([h.loss * h.count, h.top1 * h.count, h.top5 * h.count, h.count, text[k]],
                                        dtype=torch.float64)
        if acc.num_processes > 1:
            sums = acc.reduce(sums.to(acc.device), reduction="sum").cpu()
        record = {"step": self.step, "split": "eval"}
        weights = _head_weights(k_heads, self.cfg.loss.head_decay)
        total = 0.0
        for k in range(k_heads):
            n = max(sums[k, 3].item(), 1.0)
            record.update({f"head{k + 1}/loss": sums[k, 0].item() / n, f"head{k + 1}/top1": sums[k, 1].item() / n,
                           f"head{k + 1}/top5": sums[k, 2].item() / n})
            if greedy:  # share of the text's targets that greedy targets keep
                record[f"head{k + 1}/kept"] = sums[k, 3].item() / max(sums[k, 4].item(), 1.0)
            total += weights[k] * sums[k, 0].item() / n
        record["loss"] = total
        self.metrics.write(record)
        if acc.is_main_process:
            tops = " ".join(f"{record[f'head{k + 1}/top1']:.3f}" for k in range(k_heads))
            kept = " ".join(f"{record[f'head{k + 1}/kept']:.0%}" for k in range(k_heads)) if greedy else ""
            self.log(f"eval @ step {self.step}: loss {total:.4f}, top-1 by head {tops}"
                     + (f"; greedy targets keep {kept} of the text's" if kept else ""))
        if greedy and sums[0, 3] == 0 and sums[0, 4] > 0:
            raise ValueError(
                "loss.targets=greedy: the held-out text never agrees with the backbone's own greedy choices, so "
                "no head has a target. Train on text this backbone wrote (scripts/distill.py), or use loss.targets=text")
        return record

    def check_ranks_agree(self) -> None:
        """After training, every process must hold the same weights (same averaged gradients)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return
        checksum = torch.stack([p.detach().double().sum() for p in self.parameters.values()]).sum().view(1)
        sums = acc.gather(checksum.to(acc.device)).cpu()
        if not torch.allclose(sums, sums[0].expand_as(sums), rtol=1e-9, atol=0):
            raise RuntimeError(f"trainable weights diverged across processes: {sums.tolist()}")
        self.log(f"heads identical on all {acc.num_processes} processes")

    # ------------------------------------------------------------------------------------ save
    def save_checkpoint(self) -> None:
        acc = self.accelerator
        rng = [checkpoint.rng_state()]
        if acc.num_processes > 1:
            from accelerate.utils import gather_object

            rng = gather_object(rng)
        if acc.is_main_process:
            path = checkpoint.save_checkpoint(
                self.output_dir, self.step, dict(self.parameters), self.optimizer, self.scheduler,
                {"epoch": self.epoch, "micro_in_epoch": self.micro_in_epoch}, rng, self.cfg.trainer.keep_last)
            self.log(f"checkpoint: {path}")
        acc.wait_for_everyone()

    def export(self) -> Path | None:
        """Write the trained heads (native format) and the training config to ``<output_dir>/export``."""
        if not self.cfg.trainer.export:
            return None
        target = self.output_dir / "export"
        if self.accelerator.is_main_process:
            self.model.save_pretrained(target)
            (target / "training_config.json").write_text(json.dumps(to_dict(self.cfg), indent=2) + "\n")
            self.log(f"exported heads to {target}")
        self.accelerator.wait_for_everyone()
        return target

    def cleanup(self) -> None:
        self.accelerator.end_training()

    def log(self, message: str) -> None:
        if self.accelerator.is_main_process:
            print(f"[medusa_train] {message}", flush=True)


def _head_weights(num_heads: int, decay: float) -> list[float]:
    from medusa_train.training.losses import head_weights

    return head_weights(num_heads, decay)


def _merge(results: list[LossResult]) -> dict:
    """Average the metrics of the micro-batches of one optimizer step (weighted by token counts)."""
    merged: dict[str, float] = {"loss": sum(float(r.loss) for r in results) / len(results)}
    for k in range(len(results[0].per_head)):
        n = sum(r.per_head[k].count for r in results) or 1
        for name in ("loss", "top1", "top5"):
            merged[f"head{k + 1}/{name}"] = sum(getattr(r.per_head[k], name) * r.per_head[k].count
                                                for r in results) / n
    return merged


def _average_gradients(params: list[torch.nn.Parameter], accelerator) -> None:
    """Average gradients over processes (what DDP would do), with one flat all-reduce."""
    if accelerator.num_processes == 1:
        return
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1).float() for p in params])
    dist.all_reduce(flat)
    flat /= accelerator.num_processes
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def _cosine_schedule(optimizer, warmup: int, total: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def recipe_class(method: str) -> type[Medusa1Recipe]:
    if method == "medusa2":
        from medusa_train.training.medusa2 import Medusa2Recipe  # peft and bitsandbytes only when asked for

        return Medusa2Recipe
    return Medusa1Recipe


def run(cfg: TrainConfig) -> dict:
    """Run the recipe named by ``cfg.method``; returns the last eval metrics."""
    recipe = recipe_class(cfg.method)(cfg)
    recipe.setup()
    try:
        metrics = recipe.train()
        recipe.export()
    finally:
        recipe.cleanup()
    return metrics


def main() -> None:
    """Hydra entry point (the root ``train.py`` calls this)."""
    import hydra

    @hydra.main(config_path=str(CONFIG_DIR), config_name="train", version_base="1.3")
    def _main(raw) -> None:
        from medusa_train.config.train import ConfigError

        try:
            cfg = build_config(raw)
        except ConfigError as err:
            print(err, file=sys.stderr)
            sys.exit(2)
        run(cfg)

    from medusa_train.cli.launch import relaunch_cpu_processes_if_asked

    relaunch_cpu_processes_if_asked()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _main()
