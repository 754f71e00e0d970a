"""A chat template given as a setting (``data.chat_template`` in training, ``chat_template`` in distillation):
the template's own text, or a file that holds it. One resolution for every command that takes one, so that
what training renders with is what distillation, evaluation and the exports render with.
"""

from __future__ import annotations

import os
from pathlib import Path


def is_inline_template(value: str) -> bool:
    """Whether ``value`` is a template's text (it holds ``{{`` or ``{%``) rather than a file's path."""
    return "{{" in value or "{%" in value


def resolve_chat_template(value: str) -> str:
    """The template ``value`` means: itself when it is a template's text, else the text of the file it names.

    Args:
        value: A Jinja template, or the path of a file holding one (``~`` expanded).

    Raises:
        FileNotFoundError: ``value`` is neither a template nor an existing file.
    """
    if is_inline_template(value):
        return value
    return Path(value).expanduser().read_text(encoding="utf-8")


def chat_template_problem(key: str, value: str | None) -> str | None:
    """The problem with a chat-template setting, naming ``key`` (``None``: unset or usable)."""
    if not value or is_inline_template(value) or os.path.isfile(os.path.expanduser(value)):
        return None
    return f"{key}={value!r}: must be a Jinja template's text or a file holding one"


def tokenizer_template(tokenizer) -> str | None:
    """The template ``tokenizer`` renders chats with (a tokenizer with several named ones: its ``default``)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template or None
