"""One dtype vocabulary for every command: the spellings a config takes, and the one name passed on.

``model.dtype=bf16`` and ``model.dtype=bfloat16`` are the same setting in every command. Each command's
config check calls ``parse_dtype``, which stores the canonical name (``bfloat16``) in the config, so what
the backbone loader, vLLM's ``--dtype``, the run records and the folders keyed by settings see is always
one of ``DTYPES``; a value outside the vocabulary is a problem naming its key:
``model.dtype='bf17': must be one of float32, bfloat16, float16 (or fp32, bf16, fp16)``.
"""

from __future__ import annotations

DTYPES = ("float32", "bfloat16", "float16")  #: the canonical names, as torch and vLLM spell them
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  #: the short spellings also taken
AUTO = "auto"  #: where a command can choose for the machine (the demo), resolved before anything is keyed


def canonical_dtype(value, *, auto: bool = False, allowed: tuple[str, ...] = DTYPES) -> str | None:
    """The canonical name of ``value`` (``"bf16"`` -> ``"bfloat16"``), or ``None`` if it is not a dtype taken here.

    A ``torch.dtype`` counts by its name; ``auto`` only where ``auto=True``; ``allowed``: the canonical names a
    command runs in (the demo: no float16)."""
    name = value if isinstance(value, str) else str(value).removeprefix("torch.")
    if auto and name == AUTO:
        return AUTO
    name = ALIASES.get(name, name)
    return name if name in allowed else None


def dtype_rule(*, auto: bool = False, allowed: tuple[str, ...] = DTYPES) -> str:
    """What a dtype key takes, as the problem message says it."""
    names = ", ".join(((AUTO,) if auto else ()) + tuple(allowed))
    short = ", ".join(alias for alias, name in ALIASES.items() if name in allowed)
    return f"must be one of {names} (or {short})"


def parse_dtype(problems: list[str], section, key: str, attr: str = "dtype", *, auto: bool = False,
                optional: bool = False, allowed: tuple[str, ...] = DTYPES) -> str | None:
    """Check ``section.<attr>`` (reported as ``key``) and store its canonical name there.

    Args:
        problems: where a problem is added (``key='x': must be one of ...``); the value is then left as it was.
        section: the config dataclass holding the dtype.
        key: the dotted key the user sets (``model.dtype``).
        attr: the field's name in ``section``.
        auto: whether ``auto`` is taken (kept as ``auto``).
        optional: whether ``null`` is taken (kept as ``None``).
        allowed: the canonical names taken (default: all of ``DTYPES``).

    Returns:
        The canonical name (``None`` for an accepted null or a problem).
    """
    value = getattr(section, attr)
    if value is None and optional:
        return None
    name = canonical_dtype(value, auto=auto, allowed=allowed) if isinstance(value, str) else None
    if name is None:
        problems.append(f"{key}={value!r}: {dtype_rule(auto=auto, allowed=allowed)}")
        return None
    setattr(section, attr, name)
    return name


def torch_dtype(value):
    """The ``torch.dtype`` of a dtype name in any accepted spelling (a ``torch.dtype`` is returned as it is).

    Raises:
        ValueError: ``dtype='x': must be one of float32, bfloat16, float16 (or fp32, bf16, fp16)``.
    """
    import torch

    if isinstance(value, torch.dtype):
        return value
    name = canonical_dtype(value) if isinstance(value, str) else None
    if name is None:
        raise ValueError(f"dtype={value!r}: {dtype_rule()}")
    return getattr(torch, name)
