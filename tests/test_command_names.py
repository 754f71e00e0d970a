"""One way to say a command: what the package prints (messages, ``--help``, the headers of the YAML it ships and
of the tree YAML it writes) and what the guides tell a user to run is ``medusa-train <command>``, the installed
command, never a checkout's ``scripts/<command>.py`` or ``python train.py`` (a wheel has neither; the checkout's
shims and ``accelerate launch train.py`` stay). docs/log/ is a dated history and is left as it was."""

import re

import pytest
from helpers import ROOT

# built here, so that this file does not hold what it looks for
CHECKOUT_COMMANDS = re.compile("python " + "(scripts/|train[.]py)")
SCRIPT_PATH = re.compile(r"\bscripts" + r"/\w+[.]py")  # a wheel has no scripts/ to name
SHIPPED = sorted([*(ROOT / "medusa_train").rglob("*.py"), *(ROOT / "configs").rglob("*.yaml")])
GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def hits(paths, pattern) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in paths
            for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]


@pytest.mark.parametrize("paths", [SHIPPED, GUIDES], ids=["package and configs", "README and guides"])
def test_no_one_is_told_to_run_a_checkout_script(paths):
    found = hits(paths, CHECKOUT_COMMANDS)
    assert not found, "say medusa-train <command>:\n" + "\n".join(found)


def test_the_package_names_no_checkout_script():
    found = hits(SHIPPED, SCRIPT_PATH)
    assert not found, "say medusa-train <command>:\n" + "\n".join(found)
