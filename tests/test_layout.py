"""The package's layout, read from its source (AST, nothing imported): modules stay small, imports run
one way along the data flow and never in a circle, and the head variants' knobs stay inside the Medusa family's folder. The
package imports nothing of the checkout around it (benchmarks/, scripts/, tests/: a wheel has none of them),
and no code of the repository edits the module search path (modules are found as packages, never by path).

A family's folder (``families/<name>/``) holds modules of several stages, each named for its own: ``settings`` is
config, ``recipe*`` and ``loss`` are training, ``demo`` is pipeline, the rest model (``family_module_stage``).

Stages: config (0) < backbone (1) < model (2) < engine (3) < data (4) < training (5) = decoding (5)
< export (6) < tree (7) < evaluation (8) < pipeline (9: the demo, which runs the commands) < cli (10). A module imports only from its own stage folder or an earlier
stage (training and decoding not from each other), which keeps the pipeline's order, distill -> capture -> train
-> export -> tree -> evaluate (``PIPELINE``; distill and capture share data/; a command's config/<name>.py and
cli/<name>.py belong to the step it runs, ``COMMAND_STEPS``); the top-level ``medusa_train/__init__.py`` is exempt. Every import counts, also one
inside a function (it is still a dependency); only ``if TYPE_CHECKING:`` imports are left out.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from helpers import ROOT

from medusa_train.config.commands import COMMANDS

PACKAGE = ROOT / "medusa_train"
MAX_LINES = 400
STAGES = {"config": 0, "backbone": 1, "model": 2, "engine": 3, "data": 4, "training": 5, "decoding": 5,
          "export": 6, "tree": 7, "evaluation": 8, "pipeline": 9, "cli": 10}
# the pipeline a user runs, step by step, as the modules that do each step (a package: all its modules)
PIPELINE = (("distill", "medusa_train.data.distill"), ("capture", "medusa_train.data.capture"),
            ("train", "medusa_train.training"), ("export", "medusa_train.export"), ("tree", "medusa_train.tree"),
            ("evaluate", "medusa_train.evaluation"))
# a command's config schema and its command line belong to the step the command runs: config/<name>.py, cli/<name>.py
COMMAND_STEPS = {c.module.rsplit(".", 1)[1]: c.step for c in COMMANDS.values() if c.step}
# imports of a later step allowed by name: a training run exports its heads when it ends (trainer.export)
LATER_STEP_ALLOWED = {("medusa_train.cli.train", "medusa_train.export.run")}
HEAD_VARIANT_WORDS = ("path_input", "prefix_attention", "next_token_input")
HEAD_VARIANT_HOMES = ("families/medusa/",)  # export/ and the rest ask MedusaConfig
CHECKOUT_ONLY = ("benchmarks", "scripts", "tests", "helpers", "train")  # top-level names a wheel lacks
SEARCH_PATH_FREE = ("medusa_train", "scripts", "benchmarks", "tests")


# ------------------------------------------------------------------------------------ reading the source
@cache
def modules() -> dict[str, Path]:
    """``medusa_train.x.y`` -> its file, for every module and package ``__init__``."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@cache
def tree(name: str) -> ast.Module:
    return ast.parse(modules()[name].read_text(), filename=str(modules()[name]))


def _type_checking_only(module: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    skipped = set()
    for node in ast.walk(module):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def imports(name: str) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at module level)`` for every import of a package module by ``name``."""
    known, module = modules(), tree(name)
    is_package = modules()[name].name == "__init__.py"
    skipped = _type_checking_only(module)
    top_level = {id(n) for n in module.body}
    found = []
    for node in ast.walk(module):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        else:
            continue
        for target in dict.fromkeys(targets):
            if target == "medusa_train" or target.startswith("medusa_train."):
                while target not in known:  # ``import medusa_train.x.Name``-style leftovers
                    target = target.rsplit(".", 1)[0]
                found.append((target, node.lineno, id(node) in top_level))
    return found


def family_module_stage(module: str) -> str:
    """The stage of a module in a family's folder, by its name (``families/__init__.py``)."""
    if module == "settings":
        return "config"
    if module.startswith("recipe") or module == "loss":
        return "training"
    if module == "demo":
        return "pipeline"
    return "model"


def stage_of(name: str) -> str | None:
    parts = name.split(".")
    if parts[1:] == ["__main__"]:
        return "cli"  # python -m medusa_train: the command, as cli/main.py
    if parts[1:2] == ["families"]:  # a family's folder spans stages: each module's name says its own
        return family_module_stage(parts[3]) if len(parts) > 3 else "config"  # a package face imports nothing
    return parts[1] if len(parts) > 1 else None  # None: the top-level package itself


def where(name: str, line: int) -> str:
    return f"{modules()[name].relative_to(ROOT)}:{line}"


# ------------------------------------------------------------------------------------ the checks
def long_modules() -> list[str]:
    lengths = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    return [f"{modules()[n].relative_to(ROOT)}: {k} lines" for n, k in sorted(lengths.items()) if k > MAX_LINES]


def backward_imports() -> list[str]:
    offenders = []
    for name in modules():
        stage = stage_of(name)
        if stage is None:
            continue  # medusa_train/__init__.py gathers the public API from every stage
        if stage not in STAGES:
            offenders.append(f"{modules()[name].relative_to(ROOT)}: in no stage folder ({', '.join(STAGES)})")
            continue
        for target, line, _ in imports(name):
            other = stage_of(target)
            if other == stage:
                continue
            if other is None:
                problem = "imports the package root medusa_train (which loads every stage)"
            elif other not in STAGES:
                problem = f"imports {target}, in no stage folder"
            elif STAGES[other] > STAGES[stage]:
                problem = f"imports {target}: {other} ({STAGES[other]}) comes after {stage} ({STAGES[stage]})"
            elif STAGES[other] == STAGES[stage]:
                problem = f"imports {target}: {stage} and {other} are parallel stages"
            else:
                continue
            offenders.append(f"{where(name, line)}: {problem}")
    return offenders


def import_cycles() -> list[str]:
    """Strongly connected components (Tarjan) of the module import graph with more than one module,
    each with the edges that close it."""
    graph = {name: sorted({t for t, _, _ in imports(name) if t != name}) for name in modules()}
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    offenders = []
    for component in sorted(c for c in components if len(c) > 1):
        members = set(component)
        edges = [f"{where(a, line)} -> {t}{'' if top else ' (inside a function)'}"
                 for a in component for t, line, top in imports(a) if t in members and t != a]
        offenders.append(f"cycle {' <-> '.join(component)}: " + "; ".join(edges))
    return offenders


def step_of(name: str) -> int | None:
    """Index in ``PIPELINE`` of the step module ``name`` belongs to (None: no step's): a step's modules, and the
    config and command-line modules of the command that runs it (``COMMAND_STEPS``)."""
    parts = name.split(".")
    if len(parts) == 3 and parts[1] in ("config", "cli") and parts[2] in COMMAND_STEPS:
        return [step for step, _ in PIPELINE].index(COMMAND_STEPS[parts[2]])
    return next((i for i, (_, prefix) in enumerate(PIPELINE) if name == prefix or name.startswith(prefix + ".")),
                None)


def pipeline_order_breaks() -> list[str]:
    """Stage numbers that do not follow the pipeline, and imports of a later pipeline step by an earlier one."""
    offenders = []
    folders = [prefix.split(".")[1] for _, prefix in PIPELINE]
    for (step, _), (later, _), a, b in zip(PIPELINE, PIPELINE[1:], folders, folders[1:]):
        if a != b and not STAGES[a] < STAGES[b]:
            offenders.append(f"STAGES: {step} ({a}, {STAGES[a]}) must come before {later} ({b}, {STAGES[b]})")
    for name in modules():
        step = step_of(name)
        if step is None:
            continue
        for target, line, _ in imports(name):
            other = step_of(target)
            if other is not None and other > step and (name, target) not in LATER_STEP_ALLOWED:
                offenders.append(f"{where(name, line)}: {PIPELINE[step][0]} imports {target}, "
                                 f"of a later step ({PIPELINE[other][0]})")
    return offenders


def head_variant_leaks() -> list[str]:
    """Identifiers and strings naming a head variant (path_input, prefix_attention, next_token_input)
    outside the Medusa family's folder."""
    hits: dict[tuple[str, int], set[str]] = {}
    for name, path in modules().items():
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(HEAD_VARIANT_HOMES):
            continue
        for node in ast.walk(tree(name)):
            if isinstance(node, ast.Name):
                words = [node.id]
            elif isinstance(node, ast.Attribute):
                words = [node.attr]
            elif isinstance(node, ast.keyword):
                words = [node.arg or ""]
            elif isinstance(node, ast.arg):
                words = [node.arg]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                words = [node.name]
            elif isinstance(node, ast.alias):
                words = [node.name, node.asname or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                words = [node.value]  # docstrings and config keys too
            else:
                continue
            found = {w for w in HEAD_VARIANT_WORDS for text in words if w in text}
            if found:
                hits.setdefault((name, getattr(node, "lineno", 0)), set()).update(found)
    return [f"{where(name, line)}: {', '.join(sorted(words))}" for (name, line), words in sorted(hits.items())]


def imports_from_the_checkout() -> list[str]:
    """Imports by the package of the repository's folders outside it (``CHECKOUT_ONLY``)."""
    offenders = []
    for name in modules():
        for node in ast.walk(tree(name)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            else:
                continue
            offenders += [f"{where(name, node.lineno)}: imports {t}" for t in targets
                          if t.split(".")[0] in CHECKOUT_ONLY]
    return offenders


def search_path_edits() -> list[str]:
    """Every use of the ``sys`` module's ``path`` list (read or written) in the repository's code, by file and line."""
    files = [f for folder in SEARCH_PATH_FREE for f in sorted((ROOT / folder).rglob("*.py"))
             if "__pycache__" not in f.parts]
    return [f"{f.relative_to(ROOT)}:{node.lineno}" for f in files for node in ast.walk(ast.parse(f.read_text()))
            if isinstance(node, ast.Attribute) and node.attr == "path" and ast.unparse(node.value) == "sys"]


def report(title: str, offenders: list[str]) -> str:
    text = f"{title}: {len(offenders)} offender(s)" + "".join(f"\n  {o}" for o in offenders)
    print(text)
    return text


# ------------------------------------------------------------------------------------ tests
def test_the_layout_is_read_from_every_stage_folder():
    """The checks below see the package (a wrong root would pass them all vacuously)."""
    assert {stage_of(n) for n in modules()} - {None} == set(STAGES)
    assert {stage_of(t) for t, _, _ in imports("medusa_train")} >= {"backbone", "model", "decoding"}
    assert any(target == "medusa_train.config.paths" for name in modules() for target, _, _ in imports(name))


def test_no_module_is_over_400_lines():
    offenders = long_modules()
    assert not offenders, report(f"modules over {MAX_LINES} lines", offenders)


def test_imports_run_only_down_the_data_flow():
    offenders = backward_imports()
    assert not offenders, report("imports from a later (or parallel) stage", offenders)


def test_the_pipeline_runs_distill_capture_train_export_tree_evaluate():
    assert all(prefix in modules() for _, prefix in PIPELINE)  # each step names a real module or package
    assert {step_of(n) for n in modules()} >= set(range(len(PIPELINE)))  # every step has its modules
    steps = [step for step, _ in PIPELINE]  # every command's config and command line is mapped to a real step
    assert {f"medusa_train.{kind}.{name}" for kind in ("config", "cli") for name in COMMAND_STEPS} <= set(modules())
    assert all(step_of(f"medusa_train.cli.{name}") == steps.index(s) for name, s in COMMAND_STEPS.items())
    offenders = pipeline_order_breaks()
    assert not offenders, report("breaks of the pipeline order", offenders)


def test_no_import_cycle_between_modules():
    offenders = import_cycles()
    assert not offenders, report("import cycles", offenders)


def test_head_variants_are_named_only_in_the_medusa_family():
    offenders = head_variant_leaks()
    assert not offenders, report(f"{', '.join(HEAD_VARIANT_WORDS)} outside {', '.join(HEAD_VARIANT_HOMES)}", offenders)


def test_the_package_imports_nothing_of_the_checkout_around_it():
    offenders = imports_from_the_checkout()
    assert not offenders, report(f"imports of {', '.join(CHECKOUT_ONLY)} from medusa_train", offenders)


def test_no_code_edits_the_module_search_path():
    assert (ROOT / "benchmarks" / "__main__.py").is_file()  # the folders below are where they are looked for
    offenders = search_path_edits()
    folders = ", ".join(SEARCH_PATH_FREE)
    assert not offenders, report(f"the module search path used in {folders} (import by package name)", offenders)
