"""Medusa-1: a frozen backbone; only the heads (and their prefix layer, if any) train.

    accelerate launch train.py +recipe=medusa1                 # frozen backbone, heads train
    accelerate launch train.py +recipe=medusa1 debug=smoke   # a few steps, minutes on CPU
    medusa-train train +recipe=medusa1 data.cache_hidden_states=true trainer.epochs=6

setup -> train -> cleanup, as torchtune's recipes (``export/run.py`` writes the export in between); the parts both recipes need
are free functions in ``loop.py``. With ``data.cache_hidden_states`` the frozen backbone runs once
over the data and the heads train from its stored hidden states.
"""

from __future__ import annotations

from pathlib import Path

import torch

from medusa_train.backbone import load_tokenizer
from medusa_train.backbone.load import load_backbone_for
from medusa_train.config.capture import capture_view
from medusa_train.config.train import TrainConfig
from medusa_train.data.capture.run import captured_already
from medusa_train.data.examples import load_examples
from medusa_train.families.medusa import recipe
from medusa_train.model.family import captured_for
from medusa_train.training import loop, setup, validation_walk
from medusa_train.training.losses import LossResult
from medusa_train.training.recipe_base import RecipeBase
from medusa_train.training.shard import shard_backbone


class Medusa1Recipe(RecipeBase):
    """Medusa-1 training, readable top to bottom."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    def setup(self) -> None:
        cfg = self.cfg
        self.accelerator = acc = setup.make_accelerator(cfg)
        sharded = setup.shards_backbone(cfg, acc)  # read by process 0, its layers sharded onto every device
        self.tokenizer = load_tokenizer(cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code)
        train, evals = load_examples(cfg.data, self.tokenizer, acc)
        backbone, has_layers = None, True
        if cfg.data.cache_hidden_states and captured_already(capture_view(cfg), captured_for(cfg), self.tokenizer, acc, train, evals):
            backbone = setup.load_without_layers_for(cfg, acc)
            has_layers = backbone is None
        if backbone is None and sharded:  # before the heads: they start from the LM head process 0 broadcasts
            backbone = setup.load_backbone_on_first_process(cfg, acc, self.tokenizer.pad_token_id)
            loop.say(acc, shard_backbone(backbone, acc.device, acc.num_processes).summary(acc.num_processes))
        elif backbone is None:
            backbone, _ = load_backbone_for(cfg.model, acc.device)
        self.model = recipe.build_heads(cfg, backbone, acc.device, train)
        self.validation = validation_walk.prepare(cfg, acc, self.tokenizer, backbone, captured_for(cfg), has_layers,
                                             sharded=sharded)
        data = setup.build_data(cfg, self.tokenizer, self.model, acc, train, evals)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.run = loop.start_run(cfg, acc, self.model, data, [{"params": trainable, "lr": cfg.optim.lr}],
                                  loop.MetricsLog(Path(cfg.trainer.output_dir), acc), sharded)

    def train(self) -> dict:
        """Train to the configured steps; returns the last eval record."""
        return loop.train_loop(self.run, self.micro_step, self.evaluate)

    def micro_step(self, batch: dict, loss_scale: float) -> LossResult:
        batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}

        def step() -> LossResult:
            hidden = loop.hidden_states(self.run, batch)
            return recipe.heads_loss(self.run, hidden, batch["labels"], self.accelerator.backward, loss_scale)[0]

        return loop.backward_step(self.run, step)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss and top-1/top-5 per head on the held-out split, over every process; the validation walk."""
        acc = self.accelerator
        sums = loop.HeadEvalSums(self.model.num_heads)
        for batch in loop.eval_batches(self.run):
            sums.add(*recipe.heads_loss(self.run, loop.hidden_states(self.run, batch), batch["labels"], None))
        record = sums.record(self.run)
        record.update(validation_walk.walk(self.validation, self.model, acc))
        self.run.metrics.write(record)
        kept = " ".join(f"{record[f'head{k + 1}/kept']:.0%}" for k in range(self.model.num_heads)) \
            if "head1/kept" in record else ""
        loop.say(self.accelerator, f"eval @ step {self.run.step}: loss {record['loss']:.4f}, top-1 by head "
                                   f"{loop.top1_summary(record, self.model.num_heads)}"
                 + (f"; greedy targets keep {kept} of the text's" if kept else ""))
        return record

