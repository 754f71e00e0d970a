"""How to serve a draft folder in its family's served layout with vLLM: the ``vllm serve`` line, its K, its base.

``medusa-train export`` prints it after writing such a folder, ``medusa-train choose-k`` after measuring K.
"""

from __future__ import annotations

import json
from pathlib import Path

from medusa_train.backbone.merge import MERGED_DIR
from medusa_train.engine.server import ENTRY_POINT, RESERVED_CPUS_ENV
from medusa_train.model.contract import vllm_speculation
from medusa_train.model.files import resolve_base_model
from medusa_train.model.folder import CHAT_TEMPLATE_NAME, DRAFT_SERVER, PLAIN_SERVER, SERVING_NAME
from medusa_train.model.load import read_exported_draft


def serve_command(path, draft=None) -> str:
    """How to serve a vllm export: ``vllm serve`` with the base model's folder (``packaged:`` names resolved,
    a folder as its absolute path), the export's dtype and ``--speculative-config``; K is the fastest measured
    by ``medusa-train choose-k`` when it ran (``serving.json``), else 1 (vLLM's own per-step cost makes more a
    loss until measured). ``draft``: the folder the export was made from, where a Medusa-2 export's base
    (``merged``, relative to it) lies. An export that carries the chat template its heads were trained with
    (``chat_template.jinja``) is served with it (``--chat-template``)."""
    path = Path(path)
    found = read_exported_draft(path)
    config, depth = found.config, found.depth
    measured = json.loads((path / SERVING_NAME).read_text()) if (path / SERVING_NAME).is_file() else None
    k = (measured or {}).get("recommended_num_speculative_tokens")
    base = served_base(config.get("base_model_name_or_path"), [d for d in (draft, path) if d is not None])
    # the dtype K was measured in (the heads' own dtype until then)
    dtype = (measured or {}).get("settings", {}).get("dtype") or config.get("torch_dtype", "auto")
    template = path / CHAT_TEMPLATE_NAME
    template = f" --chat-template {template.resolve()}" if template.is_file() else ""
    lines = []
    winner, free = (measured or {}).get("fastest_server"), (measured or {}).get("best_free")
    if winner and winner["server"] not in (PLAIN_SERVER, DRAFT_SERVER):  # a free baseline serves fastest there
        draft_best = measured["fastest_draft"]
        lines.append(f"measured ({path / SERVING_NAME}): the fastest server on {measured.get('device', 'that machine')} "
                     f"is {winner['server']}, which needs no training: {winner['tokens_per_s']:.1f} tokens/s, "
                     f"{winner['tokens_per_s'] / draft_best['tokens_per_s']:.2f}x the draft's best "
                     f"(K={draft_best['num_speculative_tokens']}); serve that:")
        lines.append(_free_line(winner, base, dtype, template))
        lines.append("or the draft, slower here:")
        k = measured["fastest_num_speculative_tokens"]
    elif measured and k is None:
        lines.append(f"measured ({path / SERVING_NAME}): no K is faster than serving {base} without speculation "
                     "on that machine; the fastest K is shown")
        k = measured["fastest_num_speculative_tokens"]
    elif measured:
        ks = [row["k"] for row in measured.get("rows", []) if row.get("k")]  # the K served, not 1..depth
        which = ", ".join(f"K={n}" for n in ks) if ks else f"K=1..{depth}"
        lines.append(f"K={k}: the fastest of {which} measured on {measured.get('device', 'this machine')} "
                     f"({path / SERVING_NAME})")
        if free:
            lines.append(f"it beats the best free baseline there, {free['server']} ({free['tokens_per_s']:.1f} "
                         f"tokens/s), by {winner['tokens_per_s'] / free['tokens_per_s']:.2f}x")
    else:
        k = 1
        lines.append(f"K=1 until measured: choose K in 1..{depth} with `medusa-train choose-k "
                     f"draft={path}` (one server per K; it writes {SERVING_NAME} here)")
    spec = json.dumps({**vllm_speculation(found.family.config), "model": str(path.resolve()), "num_speculative_tokens": k})
    lines.append(f"vllm serve {base} --dtype {dtype}{template} --speculative-config '{spec}'")
    lines.append(f"  (vLLM's CPU build, whose `vllm` script is broken, computing on every core as measured: "
                 f"{RESERVED_CPUS_ENV}=0 python -m {ENTRY_POINT} "
                 f"--model {base} --dtype {dtype}{template} --enforce-eager --speculative-config '{spec}')")
    return "serve it with vLLM:\n" + "\n".join(lines)


def _free_line(winner: dict, base: str, dtype: str, template: str) -> str:
    """The ``vllm serve`` line of a free baseline's row (``serving.json``'s ``fastest_server``)."""
    return (f"vllm serve {base} --dtype {dtype}{template} "
            f"--speculative-config '{json.dumps(winner['speculative_config'])}'"
            + ("  (suffix decoding: arctic-inference in vLLM's environment, scripts/suffix_env.sh)"
               if winner["server"] == "suffix" else ""))


def fastest_free_command(measured: dict, base: str, folder) -> str:
    """How to serve what ``medusa-train choose-k`` found fastest for a draft vLLM cannot serve (``measured``: the
    record it wrote into the draft's ``folder``, whose chat template the prompts were rendered with): the base model
    with the fastest free baseline, or alone when none beats it."""
    winner, dtype = measured["fastest_server"], measured["settings"]["dtype"]
    template = Path(folder) / CHAT_TEMPLATE_NAME
    template = f" --chat-template {template.resolve()}" if template.is_file() else ""
    if winner["server"] == PLAIN_SERVER:
        return ("serve the base model without speculation (the fastest measured here):\n"
                f"vllm serve {base} --dtype {dtype}{template}")
    return f"serve the base model with {winner['server']} (the fastest measured here):\n" + _free_line(
        winner, base, dtype, template)


def served_base(base: str | None, folders: list) -> str:
    """The base model as vLLM must be given it: a folder (``packaged:`` converted, or relative to one of
    ``folders``, as Medusa-2's ``merged`` is to its heads) as an absolute path; a hub id as it is."""
    from medusa_train.backbone.load import resolve_model_path

    if not base:
        return "<base model>"
    for folder in folders:
        found = resolve_base_model(folder, base)
        if found != base:
            return str(Path(found).resolve())
    if base == MERGED_DIR:  # Medusa-2's folder beside heads that are not here: no hub id by that name
        return f"<the {MERGED_DIR}/ folder of the Medusa-2 export these heads came from>"
    try:
        resolved = resolve_model_path(base)[0]
    except (OSError, ValueError):
        return f"<{base}: not found here; the base model's folder>"
    return str(Path(resolved).resolve()) if Path(resolved).is_dir() else resolved
