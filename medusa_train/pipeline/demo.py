"""The whole pipeline on the packaged model, as ``make demo`` runs it (``medusa-train demo``).

    medusa-train demo                                   # defaults: configs/commands/demo.yaml
    medusa-train demo distill.num_prompts=2500 distill.max_new_tokens=256 distill.batch_size=16 \
        tree.nodes=128 output_dir=outputs/scale   # the README's largest run: 2.25 tokens/step, ~85 min on 2 cores
        # (float32 then: add the dtypes of docs/results.md to repeat it exactly)
    medusa-train demo recipe=medusa2   # Medusa-2 on the same data, epochs and (teacher) targets
    medusa-train demo recipe=eagle3 train.experiment=eagle3   # an EAGLE-3 draft on the same data, its chosen tree
    medusa-train demo train.experiment=served 'train.overrides=["trainer.epochs=2"]'   # heads vLLM loads, 2 epochs

The heads train as ``medusa-train train +recipe=medusa1 experiment=demo`` (configs/experiment/demo.yaml) on the
distilled data: the demo has no training settings of its own beyond the preset, the dtype and ``train.overrides``.

Stages (declared in ``STAGES``: what each reads, writes and is keyed by; each prints the command it runs, which you can
run yourself; each stage is ``python -m medusa_train <command>``, the installed package's own commands, so the demo
runs from a wheel outside the checkout too):
  1. self-distill ShareGPT prompts with the backbone  -> <output_dir>/distill-<n>-<key>.jsonl
  2. train heads on it (experiment=demo: states cached) -> <output_dir>/medusa1-<key>/export
     (recipe=medusa2: heads on the frozen 4-bit backbone    -> <output_dir>/medusa2-stage1-<key>/export,
      then LoRA and heads jointly from them                 -> <output_dir>/medusa2-<key>/export, merged/ included;
      stages 3 and 4 then work in <output_dir>/medusa2-<key>/ and the report adds the backbone's drift)
  3. fit a tree to the heads' measured accuracies      -> <output_dir>/medusa1-<key>/tree-<key>.yaml
  4. evaluate on MT-Bench against plain decoding       -> <output_dir>/medusa1-<key>/eval-<key>/report.{json,md,png}
Each <key> hashes the settings of its stage and the stages before it (the training's: the config the train command
composes), so changing a setting starts
that stage afresh (earlier results are kept), and a stage whose output is complete is skipped.
Ends with ``mean accepted length: X.XX`` and ``speedup: Y.YYx``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, is_dataclass, replace
from functools import partial
from pathlib import Path

from medusa_train.config.check import ConfigError
from medusa_train.config.compose import compose_training
from medusa_train.config.demo import (
    DemoConfig,
    branches_fit,
    build_demo_config,
    evaluation_minutes,
    resolve_dtypes,
)
from medusa_train.config.methods import METHODS
from medusa_train.evaluation.report import headline_lines, mismatch_summary, prompts_decoded
from medusa_train.training.run_folder import RunFolder

ENV = dict(os.environ)


@dataclass(frozen=True)
class Stage:
    """One stage of the demo, declared: the command it runs, the ``stage_paths`` it reads and writes, what keys its
    output (a changed setting there starts it afresh, keeping the old output), and what it does when its way of
    running fails."""

    name: str
    command: str  #: the ``medusa-train`` command it runs (``config/commands.py``)
    reads: tuple[str, ...]  #: ``stage_paths`` keys of what it consumes
    writes: str  #: the ``stage_paths`` key of what it writes
    key: str  #: what its output's folder or file name hashes
    fallback: str | None = None  #: when its way of running fails


STAGES: tuple[Stage, ...] = (
    Stage("distill", "distill", (), "data", "the model and the distill section (the engine the data came from)",
          "in-process, saying why, where vLLM is missing or fails (the data's key then says in-process)"),
    Stage("train", "train", ("data",), "export", "the model, the distill section and the composed training settings "
          "(and a method's own stages: Medusa-2's split, Method.demo_stages)"),
    Stage("tree", "build-tree", ("export",), "tree", "the tree section (nodes=auto: also the evaluation's dtype and "
          "answer length, which its step costs are timed at)"),
    Stage("evaluate", "evaluate", ("export", "tree"), "report", "the tree and eval sections"),
)


def stage(title: str, cmd: list[str], done: bool, may_fail: bool = False) -> float | None:
    """Run one stage's command (or say why it is skipped); returns its wall time (``may_fail``: None when it
    failed, else the demo stops there)."""
    shown = " ".join(str(c) for c in cmd).replace(f"{sys.executable} -m medusa_train", "medusa-train")
    if done:
        print(f"\n== {title}: already done, skipped\n   ({shown})", flush=True)
        return 0.0
    print(f"\n== {title}\n$ {shown}", flush=True)
    started = time.perf_counter()
    result = subprocess.run([str(c) for c in cmd], env=ENV)
    if result.returncode != 0:
        if may_fail:
            return None
        sys.exit(f"demo: stage '{title}' failed (exit {result.returncode}); fix the error above and re-run: "
                 "finished stages are kept")
    return time.perf_counter() - started


def engine_unavailable(d) -> str | None:
    """Why the distill stage cannot go through its engine here (None: it can, or it runs in-process anyway)."""
    if d.engine != "vllm":
        return None
    from medusa_train.engine.server import EngineError, find_engine_python

    try:
        find_engine_python()
    except EngineError as err:
        return str(err)
    return None


def in_process_instead(cfg: DemoConfig, why: str) -> None:
    """Distil in-process from here on, saying why (the data's folder key then says in-process too)."""
    print(f"\n== distilling in-process instead of through vLLM: {why}", flush=True)
    cfg.distill.engine = None


def distill_stage(cfg: DemoConfig, py: list[str], out: Path) -> float:
    """Stage 1 through the engine when there is one, else (or when it fails) in-process, saying why; its wall time."""
    if why := engine_unavailable(cfg.distill):
        in_process_instead(cfg, why)
    seconds = distill(cfg, py, out)
    if seconds is None:
        in_process_instead(cfg, f"distilling through vLLM failed (above; the server's log: "
                                f"{stage_paths(cfg)['data'].with_suffix('.vllm.log')})")
        seconds = distill(cfg, py, out)
    return seconds


def distill(cfg: DemoConfig, py: list[str], out: Path) -> float | None:
    """The distill stage through ``cfg.distill.engine`` (or in-process); its wall time, None when the engine failed."""
    d = cfg.distill
    data = stage_paths(cfg)["data"]
    distilled = _complete(data)
    if not distilled and (seed := seed_distillation(out, cfg)) is not None:
        print(f"\n== the first {seed[0]:,} prompts' replies are taken from {seed[1]} (same settings); "
              f"distilling only the rest", flush=True)
    how = ([f"engine={d.engine}", f"concurrency={d.concurrency}"] if d.engine else [f"batch_size={d.batch_size}"])
    return stage(f"1/4 self-distill ({'through ' + d.engine if d.engine else 'in-process'})", [
        *py, "distill", f"model.name_or_path={cfg.model}", f"model.dtype={d.dtype}",
        f"num_prompts={d.num_prompts}", f"max_minutes={_null(d.max_minutes)}", f"max_prompt_tokens={d.max_prompt_tokens}",
        f"max_turns={d.max_turns}",
        f"generation.max_new_tokens={d.max_new_tokens}", *how,
        f"filters.skip_truncated={str(not d.keep_truncated).lower()}", f"filters.trim_loops={str(d.trim_loops).lower()}",
        f"output={data}"], done=distilled, may_fail=bool(d.engine))


def data_summary(data: Path) -> str:
    """The distilled data's size and how it was made, from its stats file."""
    stats = json.loads(data.with_suffix(".stats.json").read_text())
    engine = stats.get("record_settings", {}).get("engine") or "in-process"
    sized = (f" (distilling stopped at max_minutes with {stats['records'] + sum(stats['skipped'].values()):,} of "
             f"{stats['selected']:,} prompts done: the data sized to this machine)"
             if stats.get("stopped_at_max_minutes") else "")
    return (f"{stats['records']:,} conversations of {stats['selected']:,} prompts, {stats['new_tokens']:,} reply "
            f"tokens, {engine}{sized}")


def newer(output: Path, *inputs: Path) -> bool:
    return output.exists() and all(output.stat().st_mtime >= i.stat().st_mtime for i in inputs if i.exists())


def build(raw) -> DemoConfig:
    """The demo's validated config (``config.demo.build_demo_config``), its training settings checked too: what the
    train command would refuse is said before anything runs, not after distilling.

    Raises:
        ConfigError: listing each problem with the key to change.
    """
    cfg = build_demo_config(raw)
    if problems := training_problems(cfg):
        raise ConfigError(problems)
    return cfg


def training_overrides(c: DemoConfig, recipe: str | None = None) -> list[str]:
    """The train command's overrides for the demo's heads, before each stage adds its data and folder.

    ``recipe`` defaults to ``c.recipe``; a resolved ``train.dtype`` (see ``resolve_dtypes``) is expected."""
    t = c.train
    return [f"+recipe={recipe or c.recipe}", f"experiment={t.experiment}", f"model.name_or_path={c.model}",
            f"model.dtype={t.dtype}", f"trainer.mixed_precision={'bfloat16' if t.dtype == 'bfloat16' else 'no'}",
            "trainer.save_every=20",  # ~10 min of a CPU's joint (medusa2) steps: a killed demo resumes there
            "trainer.eval_every=100", *t.overrides]


def training_settings(c: DemoConfig) -> dict:
    """The heads' training settings as the train command composes them (Medusa-2: Medusa-1's over ``train.experiment``,
    whose epochs and learning rate its stages split; EAGLE-3: its own): what
    the run folder is keyed by, and the epochs and learning rate Medusa-2's stages split. ``data.source`` and
    ``trainer.output_dir`` are left out: the distilled data has a key of its own and the folder is what is keyed."""
    settings = compose_training(training_overrides(c, METHODS[c.recipe].demo_settings_from or c.recipe))
    settings["data"].pop("source")
    settings["trainer"].pop("output_dir")
    return settings


def demo_stages(c: DemoConfig):
    """The module training ``c.recipe``'s draft in stages of its own (``Method.demo_stages``), None for one train
    command."""
    import importlib

    module = METHODS[c.recipe].demo_stages
    return importlib.import_module(module) if module else None


def training_problems(c: DemoConfig) -> list[str]:
    """What the train command would refuse in the demo's training settings (``train.experiment`` + ``train.overrides``),
    said now rather than after distilling; and what a method's own stages need of them (Medusa-2: epochs for both)."""
    from medusa_train.config.data import DataConfig
    from medusa_train.config.train import build_config

    probe = replace(c, train=replace(c.train, dtype="float32" if c.train.dtype == "auto" else c.train.dtype))
    try:
        settings = training_settings(probe)
        settings["data"]["source"] = DataConfig.source  # the distilled data is not there yet
        epochs = build_config(settings).trainer.epochs
    except ConfigError as err:
        return [f"train (experiment={c.train.experiment}, overrides {c.train.overrides}): {problem}"
                for problem in err.problems]
    staged = demo_stages(c)
    return staged.problems(c, epochs) if staged else []


def stage_paths(cfg: DemoConfig) -> dict[str, Path]:
    """Where each stage of ``cfg`` writes. Folders are keyed by their settings (and those of the stages
    before them): changing one starts that stage afresh, keeping the old results."""
    out = Path(cfg.output_dir)
    # an auto-sized tree is timed in the evaluation's dtype, at its mean context (its answers' length):
    # another dtype or answer length sizes it afresh
    tree_key = (_key(cfg.tree, cfg.eval.dtype, cfg.eval.max_new_tokens) if cfg.tree.nodes == "auto"
                else _key(cfg.tree))
    staged = demo_stages(cfg)
    training = training_settings(cfg)
    # a method's own training stages key its run too (Medusa-2's: their split), and write where they say
    run_dir = out / f"{cfg.recipe}-{_key(cfg.model, cfg.distill, training, *(staged.key_parts(cfg) if staged else [None]))}"
    return {"data": distill_path(out, cfg, cfg.distill.num_prompts), "run": run_dir, "export": RunFolder(run_dir).export,
            **(staged.paths(cfg, out, partial(_key, cfg.model, cfg.distill, training)) if staged else {}),
            "tree": run_dir / f"tree-{tree_key}.yaml", "report": run_dir / f"eval-{_key(cfg.tree, cfg.eval)}"}


def run(cfg: DemoConfig) -> None:
    """Run every stage that is not done yet, then print where everything went and the headline numbers."""
    from medusa_train.backbone.load import native_bf16
    from medusa_train.model.family import family_of_method

    begun = time.perf_counter()  # the demo's max_minutes counts from here
    resolve_dtypes(cfg, native_bf16())  # before any folder is keyed
    out = Path(cfg.output_dir)
    if cfg.threads:
        ENV["OMP_NUM_THREADS"] = str(cfg.threads)
    py = [sys.executable, "-m", "medusa_train"]  # the package's own commands (medusa-train <command>)
    d, t, tr, e = cfg.distill, cfg.train, cfg.tree, cfg.eval
    print(f"dtypes: distill {d.dtype}, train {t.dtype}, evaluate {e.dtype} (auto: bfloat16 where it runs natively, "
          "float32 on CPUs without AVX512-BF16 or AMX)", flush=True)
    times = {"distill": distill_stage(cfg, py, out)}
    paths = stage_paths(cfg)  # keyed by the engine the data came from
    data, run_dir, export, tree, report = (paths[k] for k in ("data", "run", "export", "tree", "report"))

    method, staged = METHODS[cfg.recipe], demo_stages(cfg)
    if staged is None:
        what = family_of_method(cfg.recipe).draft_name
        times["train"] = stage(f"2/4 train {what} ({cfg.recipe}, experiment={t.experiment})", [
            *py, "train", *training_overrides(cfg), f"data.source={data}", f"trainer.output_dir={run_dir}"],
            done=newer(RunFolder(run_dir).training_config, data))
    else:  # the method's own stages (Medusa-2: heads alone, then jointly), each a train command
        times["train"] = staged.train(cfg, [*py, "train", *training_overrides(cfg), f"data.source={data}"],
                                      training_settings(cfg), data, paths, stage)

    times["tree"] = stage("3/4 fit a tree to the heads", [
        *py, "build-tree", f"draft={export}", f"nodes={tr.nodes}", f"num_prompts={_null(tr.num_prompts)}",
        f"lookup_depth={tr.lookup_depth}", f"guard_max_minutes={_null(tr.guard_max_minutes)}",
        f"model.dtype={e.dtype}", f"answer_tokens={e.max_new_tokens}", f"output={tree}"],
        done=newer(tree, export / "model.safetensors"))

    evaluated = newer(report / "report.json", tree, export / "model.safetensors")
    budget = evaluation_minutes(cfg, time.perf_counter() - begun)
    if budget != e.max_minutes and not evaluated:
        print(f"\nevaluate: {budget:.1f} min of the demo's max_minutes={cfg.max_minutes:g} left to it (eval.max_minutes="
              f"{_null(e.max_minutes)}; its start-up and last question counted)", flush=True)
    branches, why = branches_fit(cfg, tree_facts(tree) if tree.is_file() else {}, budget)
    if why and not evaluated:
        print(f"evaluate: {why}", flush=True)
    times["evaluate"] = stage("4/4 evaluate on MT-Bench", [
        *py, "evaluate", f"draft={export}", f"tree={tree}", f"bench.limit={e.limit}",
        f"bench.turns={e.turns}", f"bench.max_minutes={_null(None if budget is None else round(budget, 2))}",
        f"bench.branches={str(branches).lower()}",
        f"generation.max_new_tokens={e.max_new_tokens}", f"model.dtype={e.dtype}",
        f"output_dir={report}", *(["drift.original=auto"] if method.adapts_backbone else [])], done=evaluated)

    record_times(run_dir, times)
    result = json.loads((report / "report.json").read_text())
    print("\n== done: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in times.items() if v))
    print(f"distilled data   {data}  ({data_summary(data)})\ndraft (native)   {export}\ntree             {tree}\n"
          f"report           {report / 'report.md'}  (+ report.json, report.png)\n"
          f"metrics          {RunFolder(run_dir).metrics}")
    for line in headline_lines(result):  # what the heads buy over the best free baseline
        print(line)
    print(f"greedy mismatches vs plain decoding: {mismatch_summary(result)}; MT-Bench questions decoded: "
          f"{prompts_decoded(result)}")
    fitted = tree_facts(tree)
    if "chosen_nodes" in fitted:
        at64 = fitted.get("sizes", {}).get("64", {}).get("expected_accept_length")
        lookup = fitted.get("chosen_lookup_nodes")
        print(f"tree: {fitted['chosen_nodes']} nodes" + (f" ({lookup} of them a lookup chain)" if lookup else "")
              + f", chosen for {fitted['device']} in {fitted['dtype']} (expected speedup {fitted['expected_speedup']:.2f}x)"
              + (f"; a 64-node tree would accept {at64:.2f} tokens per step (expected)" if at64 else ""))
    draft_only = (result.get("methods") or {}).get("draft_only")
    if draft_only:  # the headline is the hybrid tree's; the draft alone beside it, labelled
        print(f"{result['settings']['draft']} alone (same prompts, same run): {draft_only['tokens_per_forward']:.2f} "
              f"tokens per forward, {draft_only['speedup']:.2f}x; with the lookup chain:")
    print(f"mean accepted length: {result['mean_accepted_length']:.2f}")
    print(f"speedup: {result['speedup']:.2f}x")


def _null(value) -> str:
    """A value as the command line takes it (``None``: null)."""
    return "null" if value is None else str(value)


def tree_facts(path: Path) -> dict:
    """The tree YAML's keys (``chosen_nodes``, ``sizes``, ... when it was built with ``nodes=auto``)."""
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def record_times(run_dir: Path, times: dict[str, float]) -> None:
    """Add this invocation's stage wall times to ``<run_dir>/demo-times.json`` (seconds per stage,
    summed over the invocations that ran it; a skipped stage adds nothing). An attempt that was
    killed adds nothing either: a resumed stage counts only its resumed part."""
    path = run_dir / "demo-times.json"
    total = json.loads(path.read_text()) if path.exists() else {}
    for name, seconds in times.items():
        if seconds:
            total[name] = total.get(name, 0.0) + seconds
    path.write_text(json.dumps(total, indent=1) + "\n")


def distill_path(out: Path, cfg: DemoConfig, num_prompts: int | None) -> Path:
    """Where the distill stage of ``cfg`` with ``num_prompts`` prompts writes its records."""
    return out / f"distill-{num_prompts}-{_key(cfg.model, replace(cfg.distill, num_prompts=num_prompts))}.jsonl"


def seed_distillation(out: Path, cfg: DemoConfig) -> tuple[int, Path] | None:
    """Start a larger distillation from the largest finished smaller one with the same settings.

    The first n usable prompts are the same whatever ``num_prompts`` is, and the distill command
    resumes a file from the records in it, so copying a finished 1,600-prompt file in place makes
    a 2,500-prompt run distill only the other 900. The smaller run's files are left as they are.
    Returns (its number of prompts, its records file), or None when there is none or the target
    file already exists (then the distill command resumes that file itself).
    """
    target, wanted = distill_path(out, cfg, cfg.distill.num_prompts), cfg.distill.num_prompts
    if target.exists():
        return None
    sizes = [int(n) for n in {p.name.split("-")[1] for p in out.glob("distill-*-*.jsonl")} if n.isdigit()]
    for n in sorted((n for n in sizes if wanted is None or n < wanted), reverse=True):
        source = distill_path(out, cfg, n)
        if not _complete(source):
            continue
        from medusa_train.data.distill.writer import WRITTEN_BY, write_json

        settings = json.loads(source.with_suffix(".stats.json").read_text()).get("record_settings", {})
        write_json(target.with_suffix(".stats.json"),  # first: the mark that the copies are distill's own output
                   {"written_by": WRITTEN_BY, "complete": False, "record_settings": settings,
                    "seeded_from": str(source)})
        for suffix in (".skipped.jsonl", ".jsonl"):  # records last: their file is what marks the seed
            if source.with_suffix(suffix).exists():
                partial = target.with_suffix(suffix + ".partial")
                shutil.copyfile(source.with_suffix(suffix), partial)
                partial.replace(target.with_suffix(suffix))
        return n, source
    return None


def _complete(data: Path) -> bool:
    stats = data.with_suffix(".stats.json")
    return stats.is_file() and json.loads(stats.read_text()).get("complete", False)


def _key(*parts) -> str:
    """8 hex digits that change whenever any of ``parts`` (config sections) changes."""
    text = json.dumps([asdict(p) if is_dataclass(p) else p for p in parts], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:8]
