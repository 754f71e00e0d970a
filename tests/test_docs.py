"""The two pages a user reads first stay pages: ``docs/results.md`` holds current tables, one section a claim, each
with the command that reproduces it (history goes to ``docs/log/``), and the README stays short with its figures in
one table whose rows each link to the results table they come from."""

from __future__ import annotations

import re

from helpers import ROOT

RESULTS = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
RESULTS_MAX_LINES = 300
README_MAX_LINES = 180


def sections(text: str) -> dict[str, str]:
    """``{"## heading": its text up to the next "## " heading}``."""
    parts = re.split(r"(?m)^(## .*)$", text)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_results_page_is_a_page_of_current_tables():
    text = RESULTS.read_text()
    lines = len(text.splitlines())
    assert lines <= RESULTS_MAX_LINES, f"docs/results.md has {lines} lines: move history to docs/log/"
    for heading, body in sections(text).items():
        if heading == "## Conditions":
            continue
        assert re.search(r"(?m)^\|.*\|$", body), f"{heading}: no table"
        assert "```bash" in body, f"{heading}: no command that reproduces it"
        assert not re.search(r"\d{4}-\d{2}-\d{2}", heading), f"{heading}: a dated section is history (docs/log/)"


def test_the_readme_is_short_and_its_figures_sit_in_one_table_traced_to_the_results():
    text = README.read_text()
    lines = len(text.splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines"
    tables = re.findall(r"(?m)(?:^\|.*\|\n)+", text)
    assert len(tables) == 1, f"{len(tables)} tables in the README: its figures go in one"
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
               for h in re.findall(r"(?m)^#+ (.*)$", RESULTS.read_text())}
    rows = tables[0].splitlines()[2:]
    assert rows
    for row in rows:
        linked = re.findall(r"docs/results\.md#([a-z0-9-]+)", row)
        assert linked, f"a README figure with no results table behind it: {row}"
        assert set(linked) <= anchors, (row, sorted(anchors))
