"""The ``key=value`` options every benchmark takes: checked against its defaults, ``threads`` applied."""

from __future__ import annotations

import torch


def bench_options(defaults: dict, overrides: dict) -> dict | None:
    """``defaults`` updated by ``overrides``, with torch's CPU threads set when ``threads`` is given;
    None (after saying which keys are unknown) when an override is not one of ``defaults``."""
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        print(f"unknown option(s) {unknown}; known: {sorted(defaults)}")
        return None
    opts = {**defaults, **overrides}
    if opts.get("threads"):
        torch.set_num_threads(int(opts["threads"]))
    return opts
