"""The ``eagle3`` section of the training config: the EAGLE-3 draft family's settings (``+recipe=eagle3``), and what
that recipe needs of the rest of the config."""

from __future__ import annotations

from dataclasses import dataclass

from medusa_train.config.check import Problems


@dataclass
class Eagle3Settings:
    """The EAGLE-3 draft of ``+recipe=eagle3`` (one decoder layer on three of the backbone's hidden states)."""

    ttt_steps: int = 7  #: chained draft steps trained (training-time test); step s weighs loss.head_decay**s
    #: the draft scores only the K tokens most often trained on (d2t maps them back); null: every token; auto: the
    #: size worth most at K=1, the training targets' coverage against the weights a draft step reads
    #: (``model/draft_vocab.choose_draft_vocab``; the log says what each size would cover and cost)
    draft_vocab_size: int | str | None = "auto"
    #: the three backbone layers whose entering hidden state the draft reads (vLLM's count); null: (2, L//2, L-3)
    aux_layer_ids: list[int] | None = None
    intermediate_size: int | None = None  #: the draft MLP's width; null: the backbone's


def check_aux_layers(e: Eagle3Settings) -> list[str]:
    p = Problems()
    p.need(e.aux_layer_ids is None or (len(e.aux_layer_ids) == 3 and len(set(e.aux_layer_ids)) == 3
                                       and min(e.aux_layer_ids) >= 0), "eagle3.aux_layer_ids", e.aux_layer_ids,
           "must be three distinct layer indices >= 0, or null for vLLM's (2, L//2, L-3)")
    return p


def check_eagle3_settings(e: Eagle3Settings) -> list[str]:
    """Problems of an ``eagle3`` section, each naming its key."""
    p = Problems()
    p.need(e.ttt_steps >= 1, "eagle3.ttt_steps", e.ttt_steps, "must be >= 1")
    p.need(e.draft_vocab_size in (None, "auto") or (isinstance(e.draft_vocab_size, int) and e.draft_vocab_size >= 1),
           "eagle3.draft_vocab_size", e.draft_vocab_size,
           "must be >= 1 (the draft vocabulary's size), auto (chosen from the data) or null for the whole vocabulary")
    p += check_aux_layers(e)
    p.need(e.intermediate_size is None or e.intermediate_size >= 1, "eagle3.intermediate_size", e.intermediate_size,
           "must be >= 1 or null")
    return p


def eagle3_problems(c) -> list[str]:
    """What ``+recipe=eagle3`` needs of the rest of a training config ``c``: a frozen unquantized backbone on each
    process, the backbone's distribution as target (its own section: ``check_eagle3_settings``)."""
    p = Problems()
    p.need(c.loss.targets == "teacher", "loss.targets", c.loss.targets,
           "an EAGLE-3 draft learns the backbone's distribution: use loss.targets=teacher (+recipe=eagle3 sets it)")
    p.need(c.model.quantization is None, "model.quantization", c.model.quantization,
           "the EAGLE-3 recipe reads a frozen unquantized backbone: drop model.quantization")
    p.need(not c.model.fsdp, "model.fsdp", True, "the EAGLE-3 recipe does not shard the backbone: drop model.fsdp")
    return p
