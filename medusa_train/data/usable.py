"""Whether a source's conversations can be trained on: the checks, and the errors that say why not.

A source must hold at least one usable conversation (an empty file, or one whose every record is skipped,
is refused naming ``data.source`` and the skips by reason), and ``data.eval_size`` must leave at least one
conversation to train on. The rules for the split (see ``docs/guide-data.md``):

- ``data.eval_size=0``: nothing is held out; every conversation trains and no evaluation runs (logged).
- ``data.eval_size`` >= the usable conversations: refused before tokenising, naming ``data.eval_size``, the
  number of conversations and the values that work. The held-out set is never shrunk behind the user's back:
  eval numbers from a silently smaller set would not compare with other runs'.

Refusals are :class:`~medusa_train.config.check.ConfigError` (the fix is a config value); the commands print
them without a traceback and exit 2.
"""

from __future__ import annotations

import math

from medusa_train.config.check import ConfigError
from medusa_train.data.sources import SkipStats

# What each skip reason means, for the error that refuses a source whose every record was skipped.
SKIP_MEANINGS = {
    "malformed": "not JSON, or not a conversation record",
    "not_utf8": "bytes that are not UTF-8 text",
    "empty": "no turn with text",
    "unknown_role": "a role other than system/user/assistant/tool",
    "non_text_content": "an image, audio or file part",
    "no_assistant": "no assistant turn with text",
    "truncated_source": "a partial record at the end of a cut-off file",
    "no_assistant_after_truncation": "no assistant token within data.max_length",
    "template_error": "the chat template refused it",
    "tool_turns_unsupported": "tool results the chat template does not render",
    "tool_calls_unsupported": "tool calls the chat template does not render",
}


def eval_count(n: int, eval_size: int | float) -> int:
    """Conversations ``eval_size`` holds out of ``n``: an int count (at most ``n``), or a fraction in [0, 1)
    (rounded up when > 0)."""
    if isinstance(eval_size, float):
        if not 0.0 <= eval_size < 1.0:
            raise ValueError(f"data.eval_size={eval_size}: a fraction must be in [0, 1)")
        return math.ceil(eval_size * n)
    if eval_size < 0:
        raise ValueError(f"data.eval_size={eval_size}: must be >= 0")
    return min(int(eval_size), n)


def skip_counts(stats: SkipStats) -> str:
    """``no_assistant 50 (no assistant turn with text), not_utf8 3 (...)``: every skip reason with its count."""
    return ", ".join(f"{reason} {n:,}" + (f" ({SKIP_MEANINGS[reason]})" if reason in SKIP_MEANINGS else "")
                     for reason, n in sorted(stats.skipped.items()))


def _records(n: int) -> str:
    return f"{n:,} records were" if n != 1 else "1 record was"


def no_conversations_error(source: str, stats: SkipStats) -> ConfigError:
    """The error for a source with no usable conversation: empty, or every record skipped (by reason)."""
    read = stats.kept + stats.capped + stats.total_skipped
    if not read:
        why = "it holds no records (an empty file?)"
    else:
        why = f"{'all ' if read > 1 else ''}{_records(read)} skipped: {skip_counts(stats)}"
    return ConfigError([f"data.source={source!r}: no conversation to train on: {why}. Each record must be a "
                        "ShareGPT ({\"conversations\": [{\"from\", \"value\"}, ...]}) or messages ({\"messages\": "
                        "[{\"role\", \"content\"}, ...]}) conversation with at least one assistant reply with text "
                        "(docs/guide-data.md)"])


def check_selected(source: str, stats: SkipStats, selected: int, eval_size: int | float,
                   max_samples: int | None = None) -> None:
    """Before tokenising: refuse a source with no usable conversation, or an ``eval_size`` that leaves none to
    train on (``selected``: the conversations read and kept, after ``max_samples``).

    Raises:
        ConfigError: naming ``data.source`` (with the skips by reason) or ``data.eval_size`` (with the count).
    """
    if selected == 0:
        raise no_conversations_error(source, stats)
    n_eval = eval_count(selected, eval_size)
    if n_eval < selected:
        return
    capped = f" (data.max_samples={max_samples} selected them)" if stats.capped else ""
    skipped = f"; {_records(stats.total_skipped)} skipped: {skip_counts(stats)}" if stats.total_skipped else ""
    fix = (f"set data.eval_size={max(1, selected // 10)} (anything below {selected:,}) to keep a held-out set, or "
           if selected > 1 else "set ")
    asked = f"{eval_size:,} conversations" if isinstance(eval_size, int) else f"{eval_size:.0%} of the conversations"
    raise ConfigError([f"data.eval_size={eval_size!r}: holds out {asked} for evaluation, but "
                       f"data.source={source!r} has only {selected:,} usable conversations{capped}, which leaves "
                       f"none to train on{skipped}. To train, {fix}data.eval_size=0 to train on all {selected:,} "
                       "with no evaluation"])


def check_tokenized(source: str, stats: SkipStats, n_train: int, n_eval: int, eval_size: int | float) -> None:
    """After tokenising (which skips conversations too): refuse when no training example is left.

    Raises:
        ConfigError: naming ``data.source`` (nothing usable at all) or ``data.eval_size`` (only held-out examples).
    """
    if n_train:
        return
    if not n_eval:
        raise no_conversations_error(source, stats)
    raise ConfigError([f"data.eval_size={eval_size!r}: after tokenising, no training conversation of "
                       f"data.source={source!r} is usable ({skip_counts(stats)}) while {n_eval:,} are held out "
                       "for evaluation: lower data.eval_size (0: train on every conversation, no evaluation)"])


def split_notes(eval_size: int | float, n_train: int, n_eval: int) -> list[str]:
    """Log lines for a run that trains with no evaluation, saying why (empty when there is a held-out set)."""
    if n_eval:
        return []
    if not eval_size:
        return [f"data: data.eval_size={eval_size}: nothing held out; training on all {n_train:,} conversations, "
                "no evaluation"]
    return [f"data: none of the conversations held out by data.eval_size={eval_size} is usable after tokenising; "
            f"training on {n_train:,} conversations, no evaluation"]
