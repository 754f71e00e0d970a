"""One record -> one conversation: ShareGPT and messages layouts, role names, content parts, tool turns.

``normalise_record`` turns a record as users have it into ``[{"role", "content": str, ...}, ...]`` with the
roles chat templates expect (``system``, ``user``, ``assistant``, ``tool``), or raises :class:`Skip` with the
reason it is dropped (a :class:`~medusa_train.data.sources.SkipStats` key). Reading files is ``sources.py``.
"""

from __future__ import annotations

import json
import re
from typing import Any

Message = dict[str, Any]  # role, content (str); tool_calls, name, tool_call_id where given
Conversation = list[Message]

# ShareGPT names seen in the wild -> the roles chat templates expect.
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
# Tool / function results (OpenAI "tool" and older "function", glaive's "observation", Llama's "ipython").
TOOL_ROLES = ("tool", "function", "observation", "ipython")
_SURROGATE = re.compile("[\ud800-\udfff]")


class Skip(ValueError):
    """Raised by :func:`normalise_record`; ``reason`` is the ``SkipStats`` key."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _text(content: Any) -> str:
    """A turn's text: a string as it is, an OpenAI content-part list flattened to its text parts."""
    if isinstance(content, str):
        if _SURROGATE.search(content):  # bytes that were not UTF-8, or a lone \ud800 escape: not encodable text
            raise Skip("not_utf8")
        return content
    if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
        raise Skip("malformed")
    texts = []
    for part in content:
        kind = part.get("type", "text")
        if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("text", "input_text", "output_text"):
            raise Skip("malformed")
        else:  # an image, audio or file: the text alone would misstate the turn
            raise Skip("non_text_content")
    return _text("\n".join(texts))  # as vLLM and OpenAI's chat endpoint join text parts


def _tool_calls(turn: dict) -> list[dict] | None:
    """An assistant turn's tool calls in the form chat templates read (``arguments`` as a mapping when it is
    JSON text), from ``tool_calls`` or the older single ``function_call``; ``None`` when it makes none."""
    calls = turn.get("tool_calls")
    if calls is None and isinstance(turn.get("function_call"), dict):
        calls = [{"type": "function", "function": turn["function_call"]}]
    if calls is None:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              and isinstance(c["function"].get("name"), str) for c in calls):
        raise Skip("malformed")
    normalised = []
    for call in calls:
        function = dict(call["function"])
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass  # not JSON: the template gets the text as it was written
        normalised.append({k: v for k, v in {**call, "type": call.get("type") or "function",
                                             "function": function}.items() if v is not None})
    return normalised or None


def normalise_record(record: Any) -> Conversation:
    """Turn one ShareGPT or messages record into a list of role/content messages.

    Content may be a string or an OpenAI content-part list (its text parts are joined with newlines).
    Tool and function results become ``{"role": "tool", "content", ...}`` turns (with their ``name`` and
    ``tool_call_id`` when given); an assistant turn's ``tool_calls`` (or ``function_call``) are kept, its
    ``content`` may then be empty or null. Whether a chat template can render tool turns is the
    tokenizer's business (``tokenize.py``), not the reader's.

    Args:
        record: ``{"conversations": [{"from", "value"}, ...]}`` or ``{"messages": [{"role", "content"}, ...]}``.

    Returns:
        The conversation as ``[{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}, ...]``.

    Raises:
        ValueError: the record is dropped; its ``reason`` attribute is ``malformed``, ``not_utf8``, ``empty``,
            ``unknown_role``, ``non_text_content`` or ``no_assistant``.
    """
    if not isinstance(record, dict):
        raise Skip("malformed")
    turns = record.get("conversations")
    if turns is None:
        turns = record.get("messages")
    if not isinstance(turns, list):
        raise Skip("malformed")
    conversation: Conversation = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise Skip("malformed")
        # Either key pair; datasets fills absent struct keys with None, so test for None.
        role = turn.get("from") if turn.get("from") is not None else turn.get("role")
        content = turn.get("value") if turn.get("value") is not None else turn.get("content")
        if not isinstance(role, str):
            raise Skip("malformed")
        role = role.strip().lower()
        if role not in ROLE_ALIASES and role not in TOOL_ROLES:
            raise Skip("unknown_role")
        role = ROLE_ALIASES.get(role, "tool")
        calls = _tool_calls(turn) if role == "assistant" else None
        message: dict[str, Any] = {"role": role, "content": "" if content is None and calls else _text(content)}
        if calls:
            message["tool_calls"] = calls
        if role == "tool":
            message.update({k: turn[k] for k in ("name", "tool_call_id") if isinstance(turn.get(k), str)})
        conversation.append(message)
    if not any(m["content"].strip() or m.get("tool_calls") for m in conversation):
        raise Skip("empty")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in conversation):
        raise Skip("no_assistant")
    return conversation
