"""docs/refusals.md lists every refusal: each place the code raises ConfigError (or a subclass)
is one row, named by its `module:function`, and each check validate collects has its row, so a
refusal added, moved or removed without its row fails here."""

import ast
import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "slurm_autosp"
PAGE = REPO / "docs" / "refusals.md"
VALIDATE = PACKAGE / "config" / "validate.py"


def refusal_classes(texts: dict[str, str]) -> set[str]:
    """ConfigError and every class of the package derived from it, however indirectly."""
    bases = {
        name: set(re.findall(r"\w+", parents))
        for text in texts.values()
        for name, parents in re.findall(r"^class (\w+)\(([^)]*)\):", text, re.M)
    }
    names = {"ConfigError"}
    while found := {name for name, parents in bases.items() if parents & names} - names:
        names |= found
    return names


class RaiseSites(ast.NodeVisitor):
    """`module:function` of each `raise REFUSAL(...)`, the innermost function enclosing it."""

    def __init__(self, module: str, refusals: set[str]):
        self.module, self.refusals = module, refusals
        self.functions: list[str] = []
        self.sites: list[str] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Raise(self, node: ast.Raise) -> None:
        call = node.exc
        if isinstance(call, ast.Call):
            func = call.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in self.refusals:
                where = self.functions[-1] if self.functions else "<module>"
                self.sites.append(f"{self.module}:{where}")
        self.generic_visit(node)


def code_markers() -> Counter:
    texts = {str(p.relative_to(PACKAGE)): p.read_text() for p in PACKAGE.rglob("*.py")}
    refusals = refusal_classes(texts)
    raises = re.compile(rf"raise [\w.]*\b({'|'.join(refusals)})\(")
    markers: Counter = Counter()
    for module, text in texts.items():
        if raises.search(text):  # parsed only where a refusal is raised: fast
            visitor = RaiseSites(module, refusals)
            visitor.visit(ast.parse(text))
            markers.update(visitor.sites)
    checks = [
        node.name
        for node in ast.parse(VALIDATE.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_problems")
    ]
    markers.update(f"config/validate.py:{name}" for name in checks)
    return markers


def page_markers() -> Counter:
    return Counter(re.findall(r"\| `([\w/]+\.py:\w+)` \|$", PAGE.read_text(), re.M))


def test_every_refusal_has_its_row_in_docs_refusals():
    code, page = code_markers(), page_markers()
    assert sum(code.values()) > 60, "the AST walk lost the raise sites"
    missing = {m: n - page[m] for m, n in code.items() if n > page[m]}
    stale = {m: n - code[m] for m, n in page.items() if n > code[m]}
    assert not missing, f"refusals without their rows in docs/refusals.md: {missing}"
    assert not stale, f"rows in docs/refusals.md for refusals the code no longer has: {stale}"


def test_the_exit_codes_are_listed_once_in_docs_refusals():
    assert "## Exit codes" in PAGE.read_text()
    assert "refusals.md#exit-codes" in (REPO / "docs" / "verify.md").read_text()
    assert "refusals.md" in (REPO / "README.md").read_text()
