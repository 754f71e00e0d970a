"""A chat template given as a setting (``data.chat_template`` in training, ``chat_template`` in distillation):
the template's own text, or a file that holds it. One resolution for every command that takes one, so that
what training renders with is what distillation, evaluation and the exports render with.
"""

from __future__ import annotations

from pathlib import Path

from medusa_train.config.chat_template import is_inline_template


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


def tokenizer_template(tokenizer) -> str | None:
    """The template ``tokenizer`` renders chats with (a tokenizer with several named ones: its ``default``)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template or None
