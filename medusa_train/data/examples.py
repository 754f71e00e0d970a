"""The examples every recipe and the capture stage read: ``data.source`` tokenised once (the on-disk cache of
``data/cache.py``), split into train and held out, with what the log says about them."""

from __future__ import annotations

from medusa_train.backbone.chat_template import resolve_chat_template
from medusa_train.backbone.processes import say
from medusa_train.config.data import DataConfig
from medusa_train.data.cache import tokenized_splits
from medusa_train.data.validation import held_out, held_out_line, validation_prompts, validation_source


def load_examples(d: DataConfig, tokenizer, accelerator):
    """The tokenised train and held-out examples of ``data.source`` (``datasets.Dataset``s read from the on-disk
    cache: the first process makes it, the others and every later run read it), with ``data.chat_template``
    set on ``tokenizer`` first. Says how many conversations were used, and what was left out and why."""
    if d.chat_template:
        tokenizer.chat_template = resolve_chat_template(d.chat_template)
    validation = validation_prompts(validation_source(d), d.validation.size, d.validation.seed)
    with accelerator.main_process_first():
        data = tokenized_splits(tokenizer, d.source, d.max_length, d.max_samples, d.eval_size, d.seed, d.num_proc,
                                held_out=held_out(validation))
    if validation:
        removed = data.stats.skipped.get("validation_prompt", 0)
        say(accelerator, f"validation: {held_out_line(validation_source(d), validation, d.validation.size, d.validation.seed)}"
                         f" (data.validation); {removed:,} training conversation{'s' if removed != 1 else ''} "
                         "holding one removed")
    for line in data_lines(d, data):
        say(accelerator, line)
    if not len(data.train):
        raise ValueError(f"data.source={d.source}: no usable training conversation ({data.stats.summary()})")
    return data.train, data.evals


def data_lines(d: DataConfig, data) -> list[str]:
    """What the log says about the data: used of available, what was left out (capped, cut, skipped), from where."""
    st, selected = data.stats, data.selected
    used = f"data: {selected:,} of {selected + st.capped:,} conversations selected"
    if st.capped:
        used += f" (capped by data.max_samples={d.max_samples}; null reads them all)"
    lines = [f"{used}; {st.kept:,} usable after tokenising: {len(data.train):,} train, {len(data.evals):,} held out "
             "for evaluation (data.eval_size)"] + data.notes
    if st.skipped:
        lines.append(f"data: skipped {st.total_skipped:,} records: "
                     + ", ".join(f"{reason} {n:,}" for reason, n in sorted(st.skipped.items())))
    if st.truncated:
        lines.append(f"data: {st.truncated:,} conversations cut at data.max_length={d.max_length} tokens")
    how = "read the tokenised cache" if data.from_cache else "tokenised and cached"
    lines.append(f"data: {how} {data.folder} in {data.seconds:.1f} s")
    return lines
