"""Choose vLLM's ``num_speculative_tokens`` (K) by measuring it: one server per K, the same prompts each time.

    medusa-train choose-k draft=<heads> dtype=bfloat16      # what ``medusa_train.cli.choose_k`` runs

vLLM fixes K at start-up and fails to load K above the head count, so each K (0..heads by default; 0 is the
server without speculation) is served in turn, sent MT-Bench first turns greedily at concurrency 1 and at
``concurrency`` (``served.measure_phase``), and stopped. The fastest K at concurrency 1 is recommended (none when
no K beats serving without speculation) and written to ``serving.json`` in the vllm export, which the serve line
of ``medusa-train export`` reads. With ``free=true`` (the default) the engine's free baselines are served on the same
prompts too (n-gram; suffix decoding where the engine has it), and ``serving.json`` names the fastest server of all,
trained or not (``fastest_server``), with the best free one beside it (``best_free``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from medusa_train.config.choose_k import ChooseKConfig
from medusa_train.config.paths import unwritable
from medusa_train.evaluation.served_replies import REPLIES, compare_replies, replies_line, server_of
from medusa_train.model.contract import vllm_speculation
from medusa_train.model.folder import CHAT_TEMPLATE_NAME, DRAFT_SERVER, PLAIN_SERVER, SERVING_NAME


def ks_to_serve(ks: Sequence[int] | None, depth: int) -> list[int]:
    """The K values served, in order: ``ks`` as given, or 0 (no speculation) then every K up to ``depth``."""
    return list(ks) if ks is not None else list(range(0, depth + 1))


def checked(row: dict) -> bool:
    """Whether nothing contradicts a row's greedy replies: identical to the server without speculation's, or
    every difference at a near-tie rounding explains (``compare_replies``; rows never compared count as checked)."""
    return not (row.get("outputs") or {}).get("unexplained")


def choose(rows: Sequence[dict]) -> tuple[dict, dict | None, bool]:
    """``(fastest speculating row, the row without speculation or None, whether the fastest beats it)``, by
    tokens/s at concurrency 1. A K whose replies differ from plain greedy beyond rounding is never the fastest
    (where every K's do, the fastest of them is returned and beats nothing).

    Raises:
        ValueError: no row with K >= 1.
    """
    speculating = [r for r in rows if r["k"]]
    if not speculating:
        raise ValueError("no K >= 1 was measured: nothing to choose")
    right = [r for r in speculating if checked(r)]
    best = max(right or speculating, key=lambda r: r["tokens_per_s"])
    plain = next((r for r in rows if r["k"] == 0), None)
    return best, plain, bool(right) and (plain is None or best["tokens_per_s"] > plain["tokens_per_s"])


def fastest_server(rows: Sequence[dict]) -> tuple[dict, dict | None]:
    """``(the fastest row of all at concurrency 1, the fastest free baseline's row or None)``, of the rows whose
    replies nothing contradicts (``checked``)."""
    rows = [r for r in rows if checked(r)] or rows
    free = [r for r in rows if server_of(r) not in (PLAIN_SERVER, DRAFT_SERVER)]
    return (max(rows, key=lambda r: r["tokens_per_s"]),
            max(free, key=lambda r: r["tokens_per_s"]) if free else None)


def _summary(row: dict | None) -> dict | None:
    if row is None:
        return None
    return {"server": server_of(row), "num_speculative_tokens": row["k"] if server_of(row) == DRAFT_SERVER else None,
            "speculative_config": row.get("speculative_config"), "tokens_per_s": row["tokens_per_s"],
            "tokens_per_step": row.get("tokens_per_step")}


def serving_record(rows: Sequence[dict], settings: dict, base_model: str, export: str | os.PathLike,
                   device: str, not_served: dict | None = None) -> dict:
    """``serving.json``'s content: the recommended K (``None`` when the draft is not the fastest server: serving
    without speculation or a free baseline is faster), the fastest K and its row's figures (``fastest_draft``), the
    fastest server of all and the best free one (``fastest_server``, ``best_free``), every row, what could not be served and why, and how they were measured
    (``settings["dtype"]`` is the dtype the serve line uses)."""
    best = choose(rows)[0] if any(r["k"] for r in rows) else None  # None: the draft was not served
    winner, best_free = fastest_server(rows)
    return {"recommended_num_speculative_tokens": best["k"] if server_of(winner) == DRAFT_SERVER else None,
            "fastest_num_speculative_tokens": best and best["k"], "fastest_draft": _summary(best),
            "fastest_server": _summary(winner),
            "best_free": _summary(best_free), "to_pass_best_free": to_pass(rows, best_free),
            "not_served": dict(not_served or {}), "rows": list(rows),
            "settings": dict(settings), "base_model": base_model, "export": str(export), "device": device}


def with_earlier(record: dict, previous: dict | None) -> dict:
    """``record`` holding, under ``earlier``, the newest record of every other benchmark the export's
    ``serving.json`` held before (a run on MT-Bench keeps the validation prompts' figures, and the other way round):
    nothing measured is lost, the newest run decides what to serve, and a run on the same prompts replaces its own."""
    if not previous:
        return record
    earlier = dict(previous.get("earlier") or {})
    before = (previous.get("settings") or {}).get("benchmark")
    if before is not None:
        earlier[before] = {key: value for key, value in previous.items() if key != "earlier"}
    earlier.pop(record["settings"].get("benchmark"), None)
    return {**record, "earlier": earlier} if earlier else record


def to_pass(rows: Sequence[dict], free: dict | None) -> dict | None:
    """The tokens per step the draft would need at each K served to match ``free``'s tokens/s (None: no free row,
    or the draft row has no step count): its step costs what it cost here (tokens/s over tokens per step), so
    tokens per step x free tokens/s / its tokens/s. More accepted tokens a step is what more data buys
    (``python -m benchmarks curve`` fits how much a doubling adds and says at which size it would pass)."""
    if free is None:
        return None
    needs = {str(r["k"]): {"has": r["tokens_per_step"],
                           "needs": round(r["tokens_per_step"] * free["tokens_per_s"] / r["tokens_per_s"], 4)}
             for r in rows if server_of(r) == DRAFT_SERVER and checked(r) and r.get("tokens_per_step")}
    return {"server": server_of(free), "tokens_per_s": free["tokens_per_s"], "by_k": needs} if needs else None


def record_output_problem(path: str | os.PathLike, option: str = "output") -> str | None:
    """Why a serving record must not be written to ``path`` (``None``: it may): a file there that is not one
    (``serving_record``'s keys), a folder, or a place that cannot be written. Checked before any server starts."""
    path = Path(path).expanduser()
    if path.is_dir():
        return f"{option}={path}: is a folder; name a .json file"
    if path.exists():
        if read_record(path) is None:
            return (f"{option}={path}: exists and is not a record choose-k wrote; nothing was changed: choose "
                    f"another {option}= (or move the file away)")
    blocked = unwritable(path.parent)
    return f"{option}={path}: {blocked} cannot be written; choose another {option}=" if blocked else None


def read_record(path: str | os.PathLike) -> dict | None:
    """The serving record at ``path`` (``serving_record``'s keys), or None where there is none or the file is not one
    (``write_json`` then refuses to replace it)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and {"rows", "recommended_num_speculative_tokens"} <= set(record) else None


def write_json(path: str | os.PathLike, record: dict) -> Path:
    """Write ``record`` to ``path`` through a temporary file in the same folder and ``os.replace``: a crash never
    leaves a half file; a file there that is not a serving record is never replaced (``record_output_problem``)."""
    from medusa_train.config.check import FileProblem

    path = Path(path)
    if problem := record_output_problem(path):
        raise FileProblem(problem)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def format_row(row: dict, concurrency: int) -> str:
    """One table line: K, tokens/s at concurrency 1 and at ``concurrency``, tokens per decode step (after each
    reply's first; vLLM's per-drafted-step acceptance length beside it), the engine's step time, start-up."""
    per_step = f"{row['tokens_per_step']:.3f}" if row.get("tokens_per_step") else "-"
    accepted = f"{row['mean_acceptance_length']:.3f}" if row["mean_acceptance_length"] else "-"
    step = f"; a step {row['step_ms']:.1f} ms" if row.get("step_ms") else ""
    name = f"K={row['k']}" if server_of(row) in (PLAIN_SERVER, DRAFT_SERVER) else server_of(row)
    return (f"{name}: {row['tokens_per_s']:.1f} tokens/s at concurrency 1, "
            f"{row[f'tokens_per_s_c{concurrency}']:.1f} at {concurrency}; {per_step} tokens per step "
            f"(vLLM's acceptance length per drafted step {accepted}){step}; start-up {row['startup_s']:.0f} s")


def why(row: dict, plain: dict | None) -> str:
    """``: <tokens per step> tokens per step, a step <x>x the plain one``: a row's tokens/s over the plain server's
    is the first over the second (empty where the engine did not report both)."""
    if not (plain and row.get("tokens_per_step") and row.get("step_ms") and plain.get("step_ms")):
        return ""
    return f": {row['tokens_per_step']:.3f} tokens per step, a step {row['step_ms'] / plain['step_ms']:.2f}x the plain one"


def verdict(record: dict) -> str:
    """The lines that say which K was kept, how it compares with serving without speculation, and which server of
    all (free baselines included) is the fastest here."""
    rows = record["rows"]
    if not any(r["k"] for r in rows):
        return _verdict_without_draft(record)
    best, plain, faster = choose(rows)
    if faster:
        versus = f", {best['tokens_per_s'] / plain['tokens_per_s']:.2f}x without speculation{why(best, plain)}" \
            if plain else ""
        line = f"fastest at concurrency 1: K={best['k']} ({best['tokens_per_s']:.1f} tokens/s{versus})"
    elif not checked(best):
        line = ("every K's greedy replies part from serving without speculation beyond rounding: none is "
                "recommended (see each row's outputs)")
    else:
        line = (f"no K beats serving without speculation here (best K={best['k']}: "
                f"{best['tokens_per_s'] / plain['tokens_per_s']:.2f}x{why(best, plain)}); serve the base model alone")
    winner, free = fastest_server(rows)
    if free is None:
        return line
    if server_of(winner) == DRAFT_SERVER:
        return (line + f"\nthe draft at K={winner['k']} beats the best free baseline, {server_of(free)} "
                f"({free['tokens_per_s']:.1f} tokens/s), by {winner['tokens_per_s'] / free['tokens_per_s']:.2f}x")
    line += (f"\nthe fastest server here is {server_of(winner)} ({winner['tokens_per_s']:.1f} tokens/s, no "
             f"training): {winner['tokens_per_s'] / best['tokens_per_s']:.2f}x the draft's best, K={best['k']}")
    need = ((record.get("to_pass_best_free") or {}).get("by_k") or {}).get(str(best["k"]))
    if need:
        line += (f"\nto pass {server_of(free)} at K={best['k']} the draft needs {need['needs']:.3f} tokens per step "
                 f"(it has {need['has']:.3f}): more data (python -m benchmarks curve says how much)")
    return line


def served_problem(draft: str | os.PathLike) -> str | None:
    """Why vLLM cannot serve the draft in ``draft`` (a native export with a feature only our decoder has), or None."""
    from medusa_train.evaluation.engines import vllm_reason
    from medusa_train.model.load import read_exported_draft

    found = read_exported_draft(draft)
    if found.layout != found.family.layouts[0]:  # only its native layout holds what vLLM cannot serve
        return None
    return vllm_reason(found.family.config.from_dict(found.config))


def _verdict_without_draft(record: dict) -> str:
    """``verdict`` where the draft was not served (vLLM cannot): which server of those measured is the fastest."""
    rows = record["rows"]
    winner, _ = fastest_server(rows)
    plain = next((r for r in rows if server_of(r) == PLAIN_SERVER), None)
    line = f"the draft was not served: {record['not_served'].get('draft', 'not measured')}"
    if winner is plain or plain is None:
        return line + f"\nno free baseline beats serving without speculation here ({winner['tokens_per_s']:.1f} tokens/s)"
    return (line + f"\nthe fastest server here is {server_of(winner)} ({winner['tokens_per_s']:.1f} tokens/s, "
            f"{winner['tokens_per_s'] / plain['tokens_per_s']:.2f}x without speculation; no training)")


def vllm_export(cfg: ChooseKConfig) -> Path:
    """The folder the servers load: ``heads`` when vLLM loads it as it is (its family's served layout), else that
    layout written beside it (``<heads>/../vllm-export-<dtype>``, replaced whole)."""
    from medusa_train.export.write import export_folder
    from medusa_train.model.load import read_exported_draft

    heads = read_exported_draft(cfg.draft)
    if heads.served_as_is:
        return heads.path
    export = heads.path.parent / f"vllm-export-{cfg.dtype}"
    print(f"[medusa_train] choose-k: {heads.path} is not in the layout vLLM loads; writing one to {export}", flush=True)
    return export_folder(heads.path, export, heads.family.served_layout, model=cfg.model, dtype=cfg.dtype)


def measure_k(k: int, export: Path, served_model: str, conversations: Sequence[list[dict]], eos: Sequence[int],
              cfg: ChooseKConfig) -> dict:
    """Serve the base model with the draft at ``k`` tokens a step (``k=0``: without speculation), measure it, stop
    it."""
    from medusa_train.model.load import read_exported_draft

    speculation = vllm_speculation(read_exported_draft(export).family.config)
    spec = {**speculation, "model": str(export.resolve()), "num_speculative_tokens": k} if k else None
    return measure_server_row(PLAIN_SERVER if not k else DRAFT_SERVER, k, spec, export, served_model, conversations, eos, cfg)


def measure_server_row(server: str, k: int | None, spec: dict | None, export: Path, served_model: str,
                       conversations: Sequence[list[dict]], eos: Sequence[int], cfg: ChooseKConfig) -> dict:
    """Serve the base model with ``spec`` (``--speculative-config``; None: without speculation), measure it at
    concurrency 1 and ``cfg.concurrency``, stop it: one row of ``serving.json`` (``server``: which it is)."""
    from medusa_train.engine import serve
    from medusa_train.evaluation.served import COUNTER_SETTLE_S, WARMUP_TOKENS, measure_phase

    template = export / CHAT_TEMPLATE_NAME  # the template the heads were trained with, as the serve line says
    extra = [*cfg.server.args, *(["--chat-template", str(template.resolve())]
                                 if template.is_file() and "--chat-template" not in cfg.server.args else [])]
    log = export.parent / (f"vllm-k{k}.log" if server in (PLAIN_SERVER, DRAFT_SERVER) else f"vllm-{server}.log")
    with serve(served_model, dtype=cfg.dtype, speculative_config=spec, log_path=log,
               **{**cfg.server.server_kwargs(), "extra_args": extra}) as client:
        client.timeout = cfg.server.request_timeout
        client.chat(conversations[0], max_tokens=WARMUP_TOKENS, stop_token_ids=eos)  # untimed warm-up
        time.sleep(COUNTER_SETTLE_S)  # its counters land before the first phase reads them
        one = measure_phase(client, conversations, cfg.max_tokens, eos)
        many = one if cfg.concurrency == 1 else measure_phase(client, conversations, cfg.max_tokens, eos,
                                                              concurrency=cfg.concurrency)
        startup = client.server.startup_seconds
    return {"server": server, "k": k, "speculative_config": spec, "startup_s": round(startup, 1),
            "tokens_per_s": one["tokens_per_s"],
            f"tokens_per_s_c{cfg.concurrency}": many["tokens_per_s"],
            "tokens_per_step": one["tokens_per_step"], "decode_steps": one["decode_steps"], "step_ms": one["step_ms"],
            "mean_acceptance_length": one["mean_acceptance_length"], "drafted_share": one["drafted_share"],
            "per_position_acceptance": one["per_position_acceptance"], "tokens": one["tokens"],
            REPLIES: one["outputs"], "prompt_tokens": one["prompt_tokens"]}


def choose_k(cfg: ChooseKConfig, depth: int, base_model: str,
             progress: Callable[[str], None] = lambda line: print(line, flush=True)) -> tuple[Path, dict]:
    """Serve every K, measure each, write ``serving.json`` (and ``cfg.output``); returns ``(export, record)``.

    Args:
        cfg: A validated ``ChooseKConfig`` (``ks`` within 0..depth).
        depth: The heads' count (K's default range).
        base_model: The base model (``cfg.model``, else the heads' ``base_model_name_or_path`` resolved).
        progress: Gets each row's table line as it is measured.
    """
    from medusa_train.backbone.load import load_without_weights
    from medusa_train.model.load import read_exported_draft
    from medusa_train.tree.calibrate import bench_prompts

    # a draft vLLM cannot serve: the base model without speculation and the free baselines, its record in its folder
    unservable = served_problem(cfg.draft)
    export = read_exported_draft(cfg.draft).path if unservable else vllm_export(cfg)
    tokenizer, eos, _, served_model = load_without_weights(base_model)
    conversations = [[{"role": "user", "content": p.turns[0]}]
                     for p in bench_prompts(cfg.source, cfg.draft, tokenizer, cfg.limit)]
    rows = []
    not_served = {"draft": unservable} if unservable else {}
    if unservable:
        progress(f"[medusa_train] choose-k: vLLM cannot serve this draft ({unservable}): serving the base model "
                 "without speculation and the free baselines")
    for k in [0] if unservable else ks_to_serve(cfg.ks, depth):
        progress(f"[medusa_train] choose-k: serving K={k} ({served_model}, dtype {cfg.dtype}) ...")
        rows.append(measure_k(k, export, str(served_model), conversations, eos, cfg))
        progress(format_row(rows[-1], cfg.concurrency))
    if cfg.free:
        from medusa_train.evaluation.served import free_configs, suffix_problem

        if why := suffix_problem(cfg.server):
            not_served["suffix"] = why
            progress(f"[medusa_train] choose-k: suffix decoding not served: {why}")
        for name, spec in free_configs(suffix="suffix" not in not_served).items():
            progress(f"[medusa_train] choose-k: serving {name} (free: no training) ...")
            rows.append(measure_server_row(name, None, spec, export, str(served_model), conversations, eos, cfg))
            progress(format_row(rows[-1], cfg.concurrency))
    compare_replies(rows, base_model, export, conversations, cfg.dtype, eos)
    for row in rows:
        if line := replies_line(row):
            progress(line)
    settings = {"dtype": cfg.dtype, "limit": cfg.limit, "max_tokens": cfg.max_tokens,
                "concurrency": cfg.concurrency, "benchmark": cfg.source}
    record = serving_record(rows, settings, base_model, export, device_description(), not_served)
    write_json(export / SERVING_NAME, kept_record := with_earlier(record, read_record(export / SERVING_NAME)))
    if kept := sorted(kept_record.get("earlier", {})):
        progress(f"[medusa_train] choose-k: {SERVING_NAME} keeps the earlier runs on {', '.join(kept)} under "
                 "\"earlier\"; this run decides what to serve")
    if cfg.output:
        write_json(cfg.output, record)
    return export, record


def device_description() -> str:
    """What the servers ran on: the GPU's name where CUDA is, else the CPU and its core count."""
    import platform

    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible)"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
