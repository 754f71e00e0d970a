"""Self-distillation: the backbone answers the training prompts itself.

Heads learn to predict what *this* backbone will say, so the best training data is the
backbone's own replies (the Medusa paper's self-distillation). ``distill`` takes the user
turns of any conversation source, regenerates every assistant turn with the model (its own
earlier replies as context), and appends one ``{"messages": [...]}`` line per finished
conversation to a jsonl that ``data.source=`` reads directly::

    medusa-train distill num_prompts=400 generation.max_new_tokens=256

Files written for ``output=X.jsonl``:

- ``X.jsonl``: the records, each tagged with the ``id`` of its source conversation (index in
  the source + a hash of it), appended and flushed one finished conversation at a time.
- ``X.skipped.jsonl``: ``{"id", "reason"}`` of conversations whose first reply was degenerate,
  so a re-run does not regenerate them.
- ``X.stats.json``: the settings (written first) and the counts (rewritten at the end).
- ``X.chat_template.jinja``: with ``engine=vllm`` and ``chat_template=``, the template the server is given.

Prompts are rendered with the tokenizer's chat template, or with ``chat_template=`` (a template's text or
a file; resolved as training resolves ``data.chat_template``): distil with the template you will train with.

Re-running with the same output continues where it stopped: finished ids are skipped, and a
line torn by a kill is dropped before appending. Conversations that quote an evaluation
benchmark's prompts (MT-Bench by default, both turns) are never distilled.

Modules, in the order the data flows: ``prompts`` (ids, segments, selection, batch order) ->
``generate`` (batched replies) -> ``filters`` and ``repetition`` (degenerate replies) -> ``turns``
(a batch of conversations, turn by turn) -> ``writer`` (the resumable files) -> ``run`` (``distill``
and its stats). The schema is ``medusa_train.config.distill``; the command is ``medusa_train.cli.distill``.
"""

from medusa_train.config.distill import (
    DistillConfig,
    FilterConfig,
    GenerationSettings,
    build_distill_config,
    check_distill_config,
)
from medusa_train.data.distill.filters import degenerate_reason
from medusa_train.data.distill.generate import Reply, generate_replies
from medusa_train.data.distill.prompts import (
    Prompt,
    Selection,
    conversation_id,
    plan_batches,
    prompt_segments,
    select_prompts,
)
from medusa_train.data.distill.repetition import LoopTracker, loop_start, repeated_fraction
from medusa_train.data.distill.run import DistillStats, distill, report
from medusa_train.data.distill.turns import Outcome, distill_batch
from medusa_train.data.distill.writer import JsonlAppender, default_output, sidecar

__all__ = [
    "DistillConfig", "DistillStats", "FilterConfig", "GenerationSettings", "JsonlAppender", "LoopTracker",
    "Outcome", "Prompt", "Reply", "Selection", "build_distill_config", "check_distill_config",
    "conversation_id", "default_output", "degenerate_reason", "distill", "distill_batch", "generate_replies",
    "loop_start", "plan_batches", "prompt_segments", "repeated_fraction", "report", "select_prompts", "sidecar",
]
