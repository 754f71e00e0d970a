"""Draft families and training methods are declared in one place each: outside a family's own modules and the two
tables (``model/family.py``, ``config/methods.py``), no code compares a value with a family's, a method's or a
layout's name, and no function, class or variable is named after one. Read from the source (AST): docstrings and
messages may name them; imports are left out (a family's public classes are imported where they are used).

The config sections a user sets by name (``eagle3.*`` in training, ``medusa2.*`` in the demo) are user keys, like
``heads=``: reading them is not a branch on the family, so attribute access to those section names is allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

PACKAGE = ROOT / "medusa_train"
NAMES = ("eagle3", "medusa1", "medusa2")  #: the family and method names an identifier may not carry
LAYOUT_LITERALS = ("native", "medusa_v1", "vllm")
#: each family's own modules and the two tables
HOMES = {
    # the tables
    "model/family.py", "config/methods.py",
    # EAGLE-3
    "families/eagle3/config.py", "families/eagle3/model.py", "families/eagle3/recipe.py", "families/eagle3/loss.py", "families/eagle3/settings.py",
    # Medusa heads (and the methods that train them)
    "families/medusa/config.py", "families/medusa/model.py", "families/medusa/layouts.py", "families/medusa/export.py", "families/medusa/propose.py",
    "families/medusa/heads.py", "families/medusa/prefix_attention.py", "model/draft_vocab.py", "families/medusa/settings.py",
    "families/medusa/recipe_medusa1.py", "families/medusa/recipe_medusa2.py",
}
SECTIONS = ("eagle3", "medusa2")  #: config sections a user names (``eagle3.ttt_steps``, ``medusa2.stage1_epochs``)


def _literals(node: ast.AST) -> list[str]:
    """The string constants a comparison operand holds (itself, or the items of a tuple, list or set)."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def _named(name: str) -> bool:
    return any(word in name.lower() for word in NAMES)


def offenders_in(path: Path, rel: str) -> list[str]:
    """Every comparison with a family, method or layout name, and every identifier carrying one, in ``path``
    (``rel``: how it is named in the report)."""
    found, module = [], ast.parse(path.read_text(), filename=str(path))
    # a config schema's sections, named as the user names them (``eagle3: Eagle3Settings``)
    sections = {id(n.target) for n in ast.walk(module) if isinstance(n, ast.AnnAssign)
                and isinstance(n.target, ast.Name) and n.target.id in SECTIONS}
    for node in ast.walk(module):
        if isinstance(node, ast.Compare):
            # a layout's name counts where a layout or format is compared ("vllm" also names the engine)
            layouts = LAYOUT_LITERALS if any(w in ast.unparse(node) for w in ("layout", "format")) else ()
            named = [s for operand in (node.left, *node.comparators) for s in _literals(operand)
                     if s in NAMES or s in layouts]
            if named:
                found.append(f"{rel}:{node.lineno}: compares with {', '.join(repr(s) for s in named)}")
        elif isinstance(node, ast.FunctionDef | ast.ClassDef) and _named(node.name):
            found.append(f"{rel}:{node.lineno}: defines {node.name}")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _named(node.id) \
                and id(node) not in sections:
            found.append(f"{rel}:{node.lineno}: names a variable {node.id}")
        elif isinstance(node, ast.arg) and _named(node.arg):
            found.append(f"{rel}:{node.lineno}: names an argument {node.arg}")
        elif isinstance(node, ast.Attribute) and _named(node.attr) and node.attr not in SECTIONS:
            found.append(f"{rel}:{node.lineno}: reads .{node.attr}")
    return found


def family_branches() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if "__pycache__" in path.parts or rel in HOMES or path.name == "__init__.py":
            continue
        found += offenders_in(path, rel)
    return found


def test_families_and_methods_are_named_only_in_their_own_modules_and_the_two_tables():
    offenders = family_branches()
    assert not offenders, "family, method or layout names outside their homes:\n  " + "\n  ".join(offenders)


def test_the_rule_finds_a_branch_on_a_family(tmp_path):
    """The rule can fail: a branch of the kind the tables replaced is found, with its line."""
    probe = tmp_path / "probe.py"
    probe.write_text('def recipe_class(method):\n    if method == "eagle3":\n        return 1\n    eagle3_like = 2\n')
    found = offenders_in(probe, "cli/_probe_.py")
    assert found == ["cli/_probe_.py:2: compares with 'eagle3'", "cli/_probe_.py:4: names a variable eagle3_like"]


def test_every_home_is_a_module_of_the_package():
    assert all((PACKAGE / home).is_file() for home in HOMES)
