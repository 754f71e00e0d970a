"""EAGLE-3: a frozen backbone; one draft decoder layer on three of its hidden states trains (training-time test).

    medusa-train train +recipe=eagle3                          # the draft vLLM serves at full strength
    medusa-train train +recipe=eagle3 debug=smoke              # a few steps, minutes on CPU
    medusa-train train +recipe=eagle3 eagle3.draft_vocab_size=4096   # the 4,096 most trained tokens (default auto)
    medusa-train train +recipe=eagle3 data.cache_hidden_states=true   # the backbone runs once (medusa-train capture)

setup -> train -> cleanup, as the Medusa recipes (``export/run.py`` writes the export, vLLM's EAGLE-3 layout, in
between); the loop, checkpoints, resume rules and W&B are theirs (``loop.py``). The backbone runs online each step,
or once with ``data.cache_hidden_states`` (``medusa-train capture +recipe=eagle3``), for the three hidden states the
draft reads, its final ones (the teacher's logits) and, from a capture, the token ids;
``eagle3_loss.ttt_loss`` chains ``eagle3.ttt_steps`` draft steps and learns the backbone's distribution at each.
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
from medusa_train.families.eagle3.config import captured_states
from medusa_train.families.eagle3.loss import ttt_loss
from medusa_train.model.family import captured_for
from medusa_train.training import loop, setup, validation_walk
from medusa_train.training.losses import LossResult
from medusa_train.training.recipe_base import RecipeBase


class Eagle3Recipe(RecipeBase):
    """EAGLE-3 draft training, readable top to bottom."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    def setup(self) -> None:
        cfg = self.cfg
        self.accelerator = acc = setup.make_accelerator(cfg)
        self.tokenizer = load_tokenizer(cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code)
        train, evals = load_examples(cfg.data, self.tokenizer, acc)
        backbone, has_layers = None, True
        if cfg.data.cache_hidden_states and captured_already(capture_view(cfg), captured_for(cfg), self.tokenizer, acc, train, evals):
            backbone = setup.load_without_layers_for(cfg, acc)  # the embeddings and LM head the draft reads
            has_layers = backbone is None
        if backbone is None:
            backbone, _ = load_backbone_for(cfg.model, acc.device)
        token_map, choice = draft_vocabulary(cfg, backbone, train)
        if choice:
            loop.say(acc, choice)
        self.model = build_draft(cfg, backbone, acc.device, token_map)
        c = self.model.config
        loop.say(acc, f"{c.draft_name}: reads layers {c.aux_layer_ids} of {c.num_target_layers}, "
                      f"{c.draft_vocab_size:,}-token draft vocabulary, {cfg.eagle3.ttt_steps} chained steps trained")
        self.validation = validation_walk.prepare(cfg, acc, self.tokenizer, backbone, captured_for(cfg), has_layers)
        states = captured_states(backbone, self.model.config.aux_layer_ids) if cfg.data.cache_hidden_states else None
        data = setup.build_data(cfg, self.tokenizer, self.model, acc, train, evals, states)
        trainable = [p for p in self.model.draft.parameters() if p.requires_grad]
        self.run = loop.start_run(cfg, acc, self.model, data, [{"params": trainable, "lr": cfg.optim.lr}],
                                  loop.MetricsLog(Path(cfg.trainer.output_dir), acc))

    def train(self) -> dict:
        """Train to the configured steps; returns the last eval record."""
        return loop.train_loop(self.run, self.micro_step, self.evaluate)

    def loss(self, batch: dict, backward=None, loss_scale: float = 1.0) -> LossResult:
        """Training-time test on ``batch``: the frozen backbone's states, then the draft's chained steps."""
        acc = self.accelerator
        if "hidden" in batch:  # captured: the three states, the final one, and the token ids
            aux, final = self.model.split_captured(batch["hidden"])
        else:
            with torch.no_grad(), acc.autocast():
                out = self.model(batch["input_ids"], attention_mask=batch["attention_mask"])
            aux, final = out.draft_inputs, out.hidden_states
        with acc.autocast():
            return ttt_loss(self.model, aux, final, batch["input_ids"],
                            batch["attention_mask"], batch["labels"], self.cfg.eagle3.ttt_steps,
                            self.cfg.loss.head_decay, self.cfg.loss.chunk_size, backward, loss_scale)

    def micro_step(self, batch: dict, loss_scale: float) -> LossResult:
        batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
        return loop.backward_step(self.run, lambda: self.loss(batch, self.accelerator.backward, loss_scale))

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss and top-1/top-5 per chained step on the held-out split, over every process."""
        steps = self.cfg.eagle3.ttt_steps
        sums = loop.HeadEvalSums(steps)
        for batch in loop.eval_batches(self.run):
            sums.add(self.loss(batch))
        record = sums.record(self.run)
        record.update(validation_walk.walk(self.validation, self.model, self.accelerator))
        self.run.metrics.write(record)
        loop.say(self.accelerator, f"eval @ step {self.run.step}: loss {record['loss']:.4f}, top-1 by draft step "
                                   f"{loop.top1_summary(record, steps)}")
        return record


def draft_vocabulary(cfg: TrainConfig, backbone, train: list[dict]) -> tuple[torch.Tensor | None, str | None]:
    """The draft vocabulary's token ids (``None``: the whole vocabulary), the K tokens most often trained on in
    ``train`` (every process computes the same map from the same data), and with ``eagle3.draft_vocab_size=auto`` a
    line saying why that K: each size's coverage of the training targets and the share of a plain step's weights a
    draft step reads (``draft_vocab.choose_draft_vocab``)."""
    from medusa_train.families.eagle3.config import Eagle3Config
    from medusa_train.model.draft_vocab import choose_draft_vocab, label_counts, step_weights, top_tokens

    e = cfg.eagle3
    vocab = backbone.get_output_embeddings().weight.shape[0]
    if e.draft_vocab_size is None or (e.draft_vocab_size != "auto" and e.draft_vocab_size >= vocab):
        return None, None
    counts = label_counts((x["labels"] for x in train), vocab)
    if e.draft_vocab_size != "auto":
        return top_tokens(counts, e.draft_vocab_size, "eagle3.draft_vocab_size"), None
    layer = Eagle3Config.for_backbone(backbone, aux_layer_ids=e.aux_layer_ids,
                                      intermediate_size=e.intermediate_size).layer_weights()
    size, options = choose_draft_vocab(counts, backbone.get_output_embeddings().weight.shape[1], layer,
                                       step_weights(backbone.config))
    table = ", ".join(f"{o.size:,}: {o.coverage:.1%} / {o.step_share:.1%}" for o in options)
    line = (f"eagle3.draft_vocab_size=auto: {size:,} tokens (coverage of the training targets / a draft step's "
            f"weights as a share of a plain step's, by size: {table})")
    return (None if size == vocab else top_tokens(counts, size, "eagle3.draft_vocab_size")), line


def build_draft(cfg: TrainConfig, backbone, device: torch.device, token_map: torch.Tensor | None):
    """A fresh float32 draft of the method's family on ``backbone`` (frozen), scoring ``token_map``'s tokens (``draft_vocabulary``; ``None``:
    the whole vocabulary)."""
    from medusa_train.config.methods import method_named
    from medusa_train.model.family import family_named

    e = cfg.eagle3
    backbone.requires_grad_(False)
    model_class = family_named(method_named(cfg.method).family).model_class()  # EAGLE-3's, or a variant's (P-EAGLE)
    model = model_class.from_backbone(backbone, token_map=token_map, aux_layer_ids=e.aux_layer_ids,
                                      intermediate_size=e.intermediate_size, ttt_steps=e.ttt_steps, dtype="float32")
    model.config.base_model_name_or_path = str(cfg.model.name_or_path)
    model.draft.requires_grad_(True)
    model.draft.to(device)
    return model
