"""The validation walk at each training evaluation: tokens per step the draft will get when decoding.

``prepare``: once per run, the backbone's greedy continuations of the validation prompts (``data/validation.py``,
cached) and, for a frozen backbone, what the draft reads of them (the family's captured states), so that a run
training from captured states (its backbone loaded without layers) walks without its layers too: a whole backbone is
loaded for this once, then freed. ``ValidationWalk.record``: the draft walked along them (``model/walk.py``) for
each K-chain of ``data.validation.chains`` and the built-in tree cut to ``data.validation.tree_nodes``, with
teacher-forced top-1 per depth as a diagnostic (tokens outside the draft vocabulary counted as misses). A method that
adapts the backbone (Medusa-2) walks the original backbone's continuations through the adapted backbone: what its
heads accept while the adapted backbone still writes the original's text (its drift is ``evaluate``'s report).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch

from medusa_train.backbone.processes import say
from medusa_train.data.validation import (
    Continuations,
    continuations,
    held_out_line,
    validation_prompts,
    validation_source,
)
from medusa_train.model.walk import fixed_tree_choices, walk_figures, walk_line


@dataclass
class ValidationWalk:
    continuations: Continuations
    states: list[torch.Tensor] | None  #: per continuation, what the draft reads (None: the backbone runs each time)
    against: str  #: what the figures are measured on, for the log
    cfg: object  #: the run's ``TrainConfig``
    last: dict = field(default_factory=dict)  #: the last walk's record, for the export (``validation.json``)

    def first(self, n: int) -> ValidationWalk:
        """The walk over the first ``n`` continuations only: the prompts ``evaluate bench.source=validation
        bench.limit=n`` and ``choose-k source=validation limit=n`` serve (``tree/calibrate.validation_bench``: the
        same prompts, in the same order), so that walked and served figures compare on the same prompts."""
        c = self.continuations
        kept = Continuations(c.prompts[:n], c.sequences[:n], c.too_long, c.path, c.from_cache)
        return ValidationWalk(kept, None if self.states is None else self.states[:n],
                              f"{self.against}, the first {len(kept.sequences)} prompts", self.cfg)

    @torch.no_grad()
    def record(self, model, accelerator) -> dict:
        """The walk's figures as metric keys (``validation/K<k>``, ``validation/tree<n>``, ...), logged in one line."""
        v = self.cfg.data.validation
        depth = model.config.depth
        tree = fixed_tree_choices(v.tree_nodes, depth, v.top_k)
        training = model.training
        model.eval()
        try:
            with accelerator.autocast():
                figures = walk_figures(model, self.continuations.sequences, self.states, v.chains, tree, v.top_k)
        finally:
            model.train(training)
        record = {f"validation/K{k.removeprefix('chain')}": round(x, 4) for k, x in figures.items()
                  if k.startswith("chain")}
        record[f"validation/tree{len(tree) + 1}"] = round(figures["tree"], 4)
        record.update({f"validation/top1_teacher_forced/depth{d + 1}": round(a, 4)
                       for d, a in enumerate(figures["top1_teacher_forced"])})
        record["validation/outside_draft_vocab"] = round(figures["outside_draft_vocab"], 4)
        say(accelerator, f"validation ({self.against}): {walk_line(figures, len(tree) + 1)}")
        self.last = record
        return record


def prepare(cfg, accelerator, tokenizer, backbone, captured, has_layers: bool = True, adapts: bool = False,
            sharded: bool = False) -> ValidationWalk | None:
    """The run's validation walk (main process only; ``None`` on the others, with ``data.validation.size=0``, or with
    a sharded backbone, which the walk cannot run alone). ``captured``: the family's ``CapturedStates``;
    ``has_layers``: ``backbone`` is whole (else one is loaded for this and freed); ``adapts``: the backbone trains."""
    v = cfg.data.validation
    if not v.size or not accelerator.is_main_process:
        return None
    if sharded:
        say(accelerator, "validation: not walked (the backbone is sharded over the processes; build-tree and evaluate "
                         "measure the exported draft on the validation prompts)")
        return None
    source = validation_source(cfg.data)
    prompts = validation_prompts(source, v.size, v.seed)
    if not prompts:  # a walk of nothing would log 1.000 tokens per step: say there is none instead
        say(accelerator, f"validation: none ({held_out_line(source, prompts, v.size, v.seed)}); no walk is logged, "
                         "and the export records none: give a larger source or data.validation.source=")
        return None
    whole = backbone
    if not has_layers:
        from medusa_train.backbone.load import load_backbone_for

        whole, _ = load_backbone_for(cfg.model, accelerator.device)
    whole.eval()
    texts = continuations(whole, tokenizer, prompts, v.max_new_tokens, v.max_prompt_tokens)
    say(accelerator, f"validation: continuations of {source}'s validation prompts: {texts.summary()}")
    if not texts.sequences:
        say(accelerator, f"validation: none (every prompt is longer than data.validation.max_prompt_tokens="
                         f"{v.max_prompt_tokens}); no walk is logged, and the export records none")
        return None
    states, reader = None, None
    if not adapts:
        reader = captured.states(whole)
        with torch.no_grad(), accelerator.autocast():
            states = [reader(ids, torch.ones_like(ids)) for ids, _ in texts.sequences]
    if whole is not backbone:
        del whole, reader
        gc.collect()
    against = ("the original backbone's greedy continuations, read through the adapted backbone" if adapts
               else "the backbone's greedy continuations")
    return ValidationWalk(texts, states, against, cfg)


def walk(validation: ValidationWalk | None, model, accelerator) -> dict:
    """``validation``'s record for ``model`` now (empty without one: other processes, ``data.validation.size=0``)."""
    return validation.record(model, accelerator) if validation is not None else {}


def last(validation: ValidationWalk | None) -> dict:
    """The last walk's figures (empty before any, or without a walk), what the export records."""
    return validation.last if validation is not None else {}
