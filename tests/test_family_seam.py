"""Draft families and training methods are declared in one place each: a family's folder (``families/<name>/``) and
the two tables (``model/family.py``, ``config/methods.py``). Anywhere else in the package (``__init__.py`` files
included) and in ``benchmarks/``, no code compares a value with a family's, a method's or a layout's name, or tests
whether a string holds part of one (``"eagle" in cfg.method``, ``name.startswith("medusa")``), or whether an object is
of a family's class (``isinstance(config, Eagle3Config)``, ``type(m).__name__ == "MedusaModel"``); and no function,
class, argument or variable is named after one. In the package, no attribute either, nor any use of a name carrying
one (a family's class or function is reached through the table). Read from the source (AST): docstrings and
messages may name them; imports are left out (a benchmark may build a family's draft to measure it).

The names come from the tables themselves, so a new family's and method's names are checked as soon as they are
registered. The config sections a user sets by name (``eagle3.*`` in training, ``medusa2.*`` in the demo) are user
keys, like ``heads=``: reading them is not a branch on the family, so attribute access to those names is allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

from medusa_train.config.methods import DRAFT_SETTINGS, METHODS
from medusa_train.model.family import FAMILIES, LAYOUTS

PACKAGE = ROOT / "medusa_train"
BENCHMARKS = ROOT / "benchmarks"
#: the family and method names an identifier may not carry, and the words a substring test would look for
NAMES = tuple(sorted({*FAMILIES, *METHODS}))
LAYOUT_LITERALS = LAYOUTS
TABLES = ("model/family.py", "config/methods.py")
FAMILY_HOMES = "families/"  #: each family's folder, ``families/<name>/``
#: config sections a user names (``eagle3.ttt_steps``, ``medusa2.stage1_epochs``)
SECTIONS = tuple(sorted({*DRAFT_SETTINGS, "medusa2"}))
PACKAGE_NAME = "medusa_train"


def family_classes() -> set[str]:
    """The classes defined in the families' folders (their configs, models, recipes, settings)."""
    found = set()
    for path in (PACKAGE / FAMILY_HOMES).rglob("*.py"):
        found |= {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
    return found


CLASSES = frozenset(family_classes())


def _literals(node: ast.AST) -> list[str]:
    """The string constants a comparison operand holds (itself, or the items of a tuple, list or set)."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def _named(name: str) -> bool:
    lowered = name.lower()
    return lowered != PACKAGE_NAME and any(word in lowered for word in NAMES)


def _part_of_a_name(text: str) -> bool:
    """A string a substring test would use to tell a family or method apart ("eagle", "medusa", "medusa2")."""
    return len(text) >= 4 and any(text.lower() in name for name in NAMES)


def offenders_in(path: Path, rel: str, package: bool = True) -> list[str]:
    """Every comparison with (or substring test for) a family, method or layout name, every type test against a
    family's class, and every identifier carrying a family's or method's name in ``path`` (``rel``: how it is named
    in the report; ``package``: also attributes and uses of such names)."""
    found, module = [], ast.parse(path.read_text(), filename=str(path))
    sections = {id(n.target) for n in ast.walk(module) if isinstance(n, ast.AnnAssign)
                and isinstance(n.target, ast.Name) and n.target.id in SECTIONS}
    for node in ast.walk(module):
        if isinstance(node, ast.Compare):
            layouts = LAYOUT_LITERALS if any(w in ast.unparse(node) for w in ("layout", "format")) else ()
            literals = [s for operand in (node.left, *node.comparators) for s in _literals(operand)]
            named = [s for s in literals if s in NAMES or s in layouts or s in CLASSES]
            if any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
                named += [s for s in _literals(node.left) if _part_of_a_name(s) and s not in named]
            if named:
                found.append(f"{rel}:{node.lineno}: compares with {', '.join(repr(s) for s in named)}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("startswith", "endswith") and any(
                    _part_of_a_name(s) for a in node.args for s in _literals(a)):
                found.append(f"{rel}:{node.lineno}: tests a name's {func.attr}")
            elif isinstance(func, ast.Name) and func.id in ("isinstance", "issubclass") and len(node.args) == 2 and \
                    any(isinstance(n, ast.Name) and n.id in CLASSES for n in ast.walk(node.args[1])):
                found.append(f"{rel}:{node.lineno}: tests for a family's class")
        elif isinstance(node, ast.FunctionDef | ast.ClassDef) and _named(node.name):
            found.append(f"{rel}:{node.lineno}: defines {node.name}")
        elif isinstance(node, ast.Name) and _named(node.id) and id(node) not in sections:
            if isinstance(node.ctx, ast.Store):
                found.append(f"{rel}:{node.lineno}: names a variable {node.id}")
            elif package:
                found.append(f"{rel}:{node.lineno}: uses {node.id}")
        elif isinstance(node, ast.arg) and _named(node.arg):
            found.append(f"{rel}:{node.lineno}: names an argument {node.arg}")
        elif package and isinstance(node, ast.Attribute) and _named(node.attr) and node.attr not in SECTIONS:
            found.append(f"{rel}:{node.lineno}: reads .{node.attr}")
    return sorted(found, key=lambda f: (int(f.split(":")[1]), f))


def outside_the_homes() -> list[tuple[Path, str, bool]]:
    """``(file, how it is named, whether it is the package's)`` for every module the rule applies to."""
    files = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if "__pycache__" not in path.parts and rel not in TABLES and not rel.startswith(FAMILY_HOMES):
            files.append((path, rel, True))
    files += [(p, p.relative_to(ROOT).as_posix(), False) for p in sorted(BENCHMARKS.rglob("*.py"))
              if "__pycache__" not in p.parts]
    return files


def test_families_and_methods_are_named_only_in_their_folders_and_the_two_tables():
    offenders = [o for path, rel, package in outside_the_homes() for o in offenders_in(path, rel, package)]
    assert not offenders, "family, method or layout names outside their homes:\n  " + "\n  ".join(offenders)


def test_the_rule_finds_each_kind_of_branch_on_a_family(tmp_path):
    """The rule can fail: each kind of branch the tables replaced is found, with its line."""
    probe = tmp_path / "probe.py"
    probe.write_text('def recipe_class(method, config):\n'
                     '    if method == "eagle3":\n'
                     '        return 1\n'
                     '    eagle3_like = 2\n'
                     '    if "eagle" in method or method.startswith("medusa"):\n'
                     '        return 3\n'
                     '    if isinstance(config, Eagle3Config) or type(config).__name__ == "MedusaConfig":\n'
                     '        return MedusaModel\n'
                     '    if method == "medusa":\n'
                     '        return 4\n')
    found = offenders_in(probe, "cli/_probe_.py")
    assert found == ["cli/_probe_.py:2: compares with 'eagle3'", "cli/_probe_.py:4: names a variable eagle3_like",
                     "cli/_probe_.py:5: compares with 'eagle'", "cli/_probe_.py:5: tests a name's startswith",
                     "cli/_probe_.py:7: compares with 'MedusaConfig'", "cli/_probe_.py:7: tests for a family's class",
                     "cli/_probe_.py:7: uses Eagle3Config", "cli/_probe_.py:8: uses MedusaModel",
                     "cli/_probe_.py:9: compares with 'medusa'"], found
    # a benchmark may build a family's draft to measure it, but not branch on one
    assert offenders_in(probe, "benchmarks/_probe_.py", package=False) == [
        f for f in (o.replace("cli/", "benchmarks/") for o in found) if ": uses " not in f]


def test_the_rule_reaches_package_faces_and_benchmarks():
    rels = {rel for _, rel, _ in outside_the_homes()}
    assert "__init__.py" in rels and "decoding/__init__.py" in rels
    assert any(rel.startswith("benchmarks/") for rel in rels)
    assert not any(rel.startswith(FAMILY_HOMES) for rel in rels)


def test_every_family_has_a_folder_and_the_tables_are_modules_of_the_package():
    assert all((PACKAGE / table).is_file() for table in TABLES)
    folders = {p.name for p in (PACKAGE / FAMILY_HOMES).iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(FAMILIES), (folders, set(FAMILIES))
