"""A chat-template setting's check (``data.chat_template`` in training, ``chat_template`` in distillation): the
template's own text, or a file that holds it. Reading it is ``medusa_train.backbone.chat_template``'s."""

from __future__ import annotations

import os


def is_inline_template(value: str) -> bool:
    """Whether ``value`` is a template's text (it holds ``{{`` or ``{%``) rather than a file's path."""
    return "{{" in value or "{%" in value


def chat_template_problem(key: str, value: str | None) -> str | None:
    """The problem with a chat-template setting, naming ``key`` (``None``: unset or usable)."""
    if not value or is_inline_template(value) or os.path.isfile(os.path.expanduser(value)):
        return None
    return f"{key}={value!r}: must be a Jinja template's text or a file holding one"
