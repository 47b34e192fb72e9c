"""The README and the pages under docs/ stay true to the code and to each other: every module
is listed (every config key: tests/test_config_reference.py), the families table is the
battery's, the README stays short enough to read in one sitting and indexes every page, and no
relative link is dangling."""

import re
from pathlib import Path

from families import families_table

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 300


def page(name: str) -> str:
    return (DOCS / name).read_text()


def test_the_layout_section_lists_every_module_and_package():
    layout = page("architecture.md").split("## Layout", 1)[1].split("```")[1]
    package = REPO / "slurm_autosp"
    modules = [
        p.name + ("/" if p.is_dir() else "")
        for p in sorted(package.iterdir())
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()
    ]
    missing = [m for m in modules if not re.search(rf"^  {re.escape(m)}\s", layout, re.M)]
    assert not missing, f"docs/architecture.md's layout section lacks {missing}"


def test_the_families_table_is_the_batterys_expected_outcomes():
    holders = [p for p in sorted(DOCS.glob("*.md")) if "<!-- families -->\n" in p.read_text()]
    assert len(holders) == 1, f"one page under docs/ holds the families table, not {holders}"
    text = holders[0].read_text()
    table = text.split("<!-- families -->\n", 1)[1].split("\n<!-- /families -->", 1)[0]
    where = holders[0].relative_to(REPO)
    assert table == families_table(), f"replace {where}'s families table with:\n{families_table()}"


def test_the_readme_is_read_in_one_sitting():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, over {README_MAX_LINES}: move detail into a page under docs/"
    )


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def relative_links(path: Path) -> list[str]:
    """The targets of `path`'s markdown links that are not URLs or anchors in the same page,
    outside fenced code."""
    text = FENCE.sub("", path.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


def target(path: Path, link: str) -> Path:
    return (path.parent / link.split("#", 1)[0]).resolve()


def test_the_readme_links_every_docs_page():
    linked = {target(README, link) for link in relative_links(README)}
    pages = sorted(p for p in DOCS.rglob("*") if p.is_file())
    assert pages, "docs/ holds no pages"
    unlinked = [str(p.relative_to(REPO)) for p in pages if p.resolve() not in linked]
    assert not unlinked, f"README.md's index of docs/ lacks {unlinked}"


def test_every_relative_link_points_to_an_existing_file():
    dangling = [
        f"{path.relative_to(REPO)}: {link}"
        for path in [README, *sorted(DOCS.glob("*.md"))]
        for link in relative_links(path)
        if not target(path, link).exists()
    ]
    assert not dangling, f"links to no file: {dangling}"


def test_the_oldest_torch_ci_tests_is_pyprojects_lower_bound_and_the_readmes():
    ci = (REPO / ".ci" / "run").read_text()
    oldest = re.search(r'OLDEST_TORCH="torch==([\d.]+)"', ci).group(1)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"torch>={oldest.removesuffix(".0")}"' in pyproject
    assert f"{oldest} (the fast tier, in CI too)" in (REPO / "README.md").read_text()
