"""Chat template + assistant-only labels.

The conversation is rendered once with the tokenizer's own chat template. Each assistant
reply's character span is found by rendering prefixes of the conversation: the text of
``messages[:i]`` with the generation prompt ends where reply ``i`` begins (so the template's
scaffolding, e.g. ``<|im_start|>assistant\\n``, stays unlabelled), and the reply ends with the
first special token after its content (the end-of-turn token, e.g. ``<|im_end|>``, which the
model must learn to emit; whatever follows it, e.g. a newline, stays unlabelled). The text is
then tokenized once with offsets, and a token is labelled when it starts inside a reply span.
Nothing depends on the model's name.

Tool results and tool calls are rendered by the template when it renders them (``template_support``
probes it once per tokenizer) and are never labelled; a conversation holding what the template would
drop is skipped and counted, never trained on half-rendered.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

IGNORE_INDEX = -100

Span = tuple[int, int]


def _require_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '') or 'unnamed'}) "
            "has no chat template, so conversations cannot be rendered. Use the tokenizer of an "
            "instruct/chat model, or set `tokenizer.chat_template` to a Jinja template first."
        )


def _render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _special_strings(tokenizer: Any) -> list[str]:
    """Text of the tokenizer's special tokens (the end-of-turn token is one of them)."""
    strings = set(getattr(tokenizer, "all_special_tokens", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    strings.update(tok.content for tok in decoder.values() if getattr(tok, "special", False))
    return sorted((s for s in strings if s and s.strip()), key=len, reverse=True)


def _reply_end(text: str, start: int, limit: int, content: str, specials: list[str]) -> int:
    """End of the reply that starts at ``start``: its content plus the first special token after it."""
    stripped = content.strip()
    found = text.find(stripped, start, limit) if stripped else -1
    content_end = found + len(stripped) if found >= 0 else start
    best = -1
    for special in specials:
        at = text.find(special, content_end, limit)
        if at >= 0 and (best < 0 or at < best):
            best = at
            best_end = at + len(special)
    if best >= 0:
        return best_end
    # No special token closes the turn: take the rest of the turn without trailing whitespace.
    return content_end + len(text[content_end:limit].rstrip())


def assistant_spans(tokenizer: Any, messages: list[dict]) -> tuple[str, list[Span]]:
    """Render ``messages`` and find the character span of every assistant reply.

    Args:
        tokenizer: a tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]``.

    Returns:
        ``(text, spans)``: the rendered conversation and one ``(start, end)`` per assistant
        reply, covering its content and the end-of-turn token, not the template scaffolding.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    _require_chat_template(tokenizer)
    text = _render(tokenizer, messages, add_generation_prompt=False)
    specials = _special_strings(tokenizer)
    spans: list[Span] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or not message["content"].strip():
            continue  # only assistant text is labelled (a turn that only calls a tool is context)
        try:
            before = _render(tokenizer, messages[:i], add_generation_prompt=True)
            through = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        except Exception:  # some templates refuse a prefix (e.g. one that does not start with a user turn)
            before = through = None
        if before is not None and text.startswith(before) and text.startswith(through) and len(before) >= cursor:
            start, limit = len(before), len(through)
        else:
            # The template renders a prefix differently (e.g. a default system prompt only when
            # there are messages): find the reply's content after the previous reply instead.
            stripped = message["content"].strip()
            found = text.find(stripped, cursor) if stripped else -1
            if found < 0:
                continue  # cannot place this reply safely: leave it unlabelled rather than guess
            start, limit = found, len(text)
        end = _reply_end(text, start, limit, message["content"], specials)
        if message.get("tool_calls"):  # the turn goes on with its calls: label the text, not the call
            stripped = message["content"].strip()
            found = text.find(stripped, start, limit)
            end = found + len(stripped) if found >= 0 else start
        if end > start:
            spans.append((start, end))
            cursor = end
    return text, spans


def labels_from_offsets(input_ids: list[int], offsets: list[Span], spans: list[Span]) -> list[int]:
    """Labels equal to ``input_ids`` for tokens that start inside a span, ``IGNORE_INDEX`` elsewhere.

    Args:
        input_ids: token ids.
        offsets: ``(start, end)`` character offsets of each token in the rendered text, in order.
        spans: sorted, non-overlapping character spans to label.

    Returns:
        The labels, aligned with ``input_ids`` (not shifted).
    """
    labels = [IGNORE_INDEX] * len(input_ids)
    starts = [start for start, _ in offsets]
    for span_start, span_end in spans:
        first, stop = bisect_left(starts, span_start), bisect_left(starts, span_end)
        labels[first:stop] = input_ids[first:stop]
    return labels


# The text is cut before tokenizing, at a special token at least this many characters per
# allowed token in: generous, so the cut almost always leaves more than ``max_length`` tokens.
CHARS_PER_TOKEN_BOUND = 8


def _cut_after_special(text: str, at_least: int, specials: list[str]) -> int:
    """End of the first special token that ends at or after ``at_least``, else ``len(text)``.

    Tokenizers split the text on special tokens before anything else, so the text before a
    special token is tokenized exactly as it is inside the whole text.
    """
    if at_least >= len(text):
        return len(text)
    cut = len(text)
    for special in specials:
        at = text.find(special, max(0, at_least - len(special)))
        if at >= 0:
            cut = min(cut, at + len(special))
    return cut


def encode_rendered(tokenizer: Any, texts: list[str], max_length: int) -> list[tuple[list[int], list[Span], bool]]:
    """Tokenize rendered conversations (no special tokens added) and keep the first ``max_length`` tokens.

    Long texts are cut after a special token well past ``max_length`` tokens' worth of text, so
    a 100k-character conversation does not cost a full tokenization; the result is the same as
    tokenizing the whole text and truncating (a text whose cut holds too few tokens is redone whole).

    Returns:
        One ``(input_ids, offsets, truncated)`` per text; ``truncated``: tokens were left out.
    """
    specials = _special_strings(tokenizer)
    cuts = [_cut_after_special(text, max_length * CHARS_PER_TOKEN_BOUND, specials) for text in texts]
    results = []
    for text, cut, (ids, offsets) in zip(texts, cuts, _encode(tokenizer, [t[:c] for t, c in zip(texts, cuts)])):
        if len(ids) < max_length and cut < len(text):
            [(ids, offsets)] = _encode(tokenizer, [text])
            cut = len(text)
        truncated = len(ids) > max_length or (cut < len(text) and bool(text[cut:].strip()))
        results.append((list(ids[:max_length]), list(offsets[:max_length]), truncated))
    return results


def _encode(tokenizer: Any, texts: list[str]) -> list[tuple[list[int], list[Span]]]:
    """Token ids and character offsets of ``texts``, with no special tokens added."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # The Rust tokenizer directly skips transformers' per-text conversion; only when no earlier
    # call left truncation or padding switched on in it.
    if backend is not None and backend.truncation is None and backend.padding is None:
        return [(e.ids, e.offsets) for e in backend.encode_batch(texts, add_special_tokens=False)]
    encodings = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return list(zip(encodings["input_ids"], encodings["offset_mapping"]))


def labelled_example(input_ids: list[int], offsets: list[Span], spans: list[Span]) -> dict[str, list[int]] | None:
    """``{"input_ids", "labels"}`` with the ``spans`` labelled, or None when nothing is labelled."""
    labels = labels_from_offsets(input_ids, offsets, spans)
    if all(label == IGNORE_INDEX for label in labels):
        return None
    return {"input_ids": input_ids, "labels": labels}


def tokenize_conversation(tokenizer: Any, messages: list[dict], max_length: int) -> dict[str, list[int]] | None:
    """Apply the chat template and label only the assistant replies.

    Labels equal ``input_ids`` on each assistant reply's tokens, including the end-of-turn
    token that closes it (``<|im_end|>`` for ChatML), and are ``-100`` on system and user
    turns, on template scaffolding (``<|im_start|>assistant\\n``) and on anything after the
    end-of-turn token. Labels are aligned with ``input_ids``; the loss does the shifting.

    Args:
        tokenizer: a fast Hugging Face tokenizer with a chat template.
        messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
        max_length: keep at most this many tokens (the start of the conversation).

    Returns:
        ``{"input_ids": list[int], "labels": list[int]}``, or None when no assistant token is
        left after truncation (count it as ``no_assistant_after_truncation``).

    Raises:
        ValueError: the tokenizer has no chat template, or ``max_length < 1``.
    """
    if max_length < 1:
        raise ValueError(f"data.max_length={max_length}: must be >= 1")
    text, spans = assistant_spans(tokenizer, messages)
    [(input_ids, offsets, _)] = encode_rendered(tokenizer, [text], max_length)
    return labelled_example(input_ids, offsets, spans)


PROBE_TOOL = "medusa_probe_result_7f3a"  # marker texts no template writes by itself
PROBE_CALL = "medusa_probe_call_7f3a"


def template_support(tokenizer: Any) -> dict[str, bool]:
    """Whether the chat template renders tool results (``tool``) and assistant tool calls (``tool_calls``).

    Rendered once on a probe conversation holding marker texts: a template that drops a role or a field
    (or refuses the conversation) does not support it.
    """
    _require_chat_template(tokenizer)
    call = {"type": "function", "id": "call_0", "function": {"name": PROBE_CALL, "arguments": {"q": 1}}}
    probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "content": PROBE_TOOL, "name": PROBE_CALL, "tool_call_id": "call_0"},
             {"role": "assistant", "content": "a"}]
    try:
        text = _render(tokenizer, probe, add_generation_prompt=False)
    except Exception:  # a template that refuses tool turns or calls altogether
        text = ""
    return {"tool": PROBE_TOOL in text, "tool_calls": PROBE_CALL in text}


def unsupported_turns(messages: list[dict], support: dict[str, bool]) -> str | None:
    """The skip reason of a conversation whose tool turns the template would not render, else ``None``."""
    if not support["tool"] and any(m["role"] == "tool" for m in messages):
        return "tool_turns_unsupported"
    if not support["tool_calls"] and any(m.get("tool_calls") for m in messages):
        return "tool_calls_unsupported"
    return None


def tokenize_batch(tokenizer: Any, conversations: list[list[dict]], max_length: int,
                   support: dict[str, bool]) -> list[dict | str]:
    """Render and tokenize conversations with assistant-only labels, one fast-tokenizer call for all.

    Returns:
        Per conversation ``{"input_ids", "labels", "truncated"}``, or the skip reason (a :class:`SkipStats`
        key): ``template_error``, ``tool_turns_unsupported``, ``tool_calls_unsupported``,
        ``no_assistant_after_truncation``.
    """
    from jinja2.exceptions import TemplateError

    results: list[dict | str] = []
    rendered: list[tuple[int, str, list[Span]]] = []
    for row, messages in enumerate(conversations):
        reason = unsupported_turns(messages, support)
        if reason is None:
            try:
                rendered.append((row, *assistant_spans(tokenizer, messages)))
            except TemplateError:
                reason = "template_error"
        results.append(reason or "")
    encoded = encode_rendered(tokenizer, [text for _, text, _ in rendered], max_length) if rendered else []
    for (row, _, spans), (input_ids, offsets, truncated) in zip(rendered, encoded):
        example = labelled_example(input_ids, offsets, spans)
        results[row] = "no_assistant_after_truncation" if example is None else {**example, "truncated": truncated}
    return results
