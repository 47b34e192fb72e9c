"""README's reference sections stay true to the code: every config key and every module is
listed."""

import dataclasses
import re
from pathlib import Path

from families import readme_table
from transformers import LlamaConfig

from slurm_autosp.config import JobConfig

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def config_table() -> dict[str, str]:
    rows = re.findall(r"^\| `?([\w ]+?)`? \| (.+) \|$", README, re.M)
    return {section: keys for section, keys in rows}


def test_the_configuration_table_lists_every_key_of_every_section():
    table = config_table()
    missing = []
    for section in dataclasses.fields(JobConfig):
        if dataclasses.is_dataclass(section.default_factory):
            row = table.get(section.name, "")
            names = [f.name for f in dataclasses.fields(section.default_factory)]
        else:
            row, names = table.get("top level", ""), [section.name]
        if section.name == "model":  # the row names the Hugging Face fields as a family
            names = [n for n in names if not hasattr(LlamaConfig(), n)]
        missing += [f"{section.name}.{n}" for n in names if f"`{n}" not in row]
    assert not missing, f"README's configuration table lacks {missing}"


def test_the_layout_section_lists_every_module_and_package():
    layout = README.split("## Layout", 1)[1].split("```")[1]
    package = REPO / "slurm_autosp"
    modules = [
        p.name + ("/" if p.is_dir() else "")
        for p in sorted(package.iterdir())
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()
    ]
    missing = [m for m in modules if not re.search(rf"^  {re.escape(m)}\s", layout, re.M)]
    assert not missing, f"README's layout section lacks {missing}"


def test_the_families_table_is_the_batterys_expected_outcomes():
    table = README.split("<!-- families -->\n", 1)[1].split("\n<!-- /families -->", 1)[0]
    assert table == readme_table(), f"replace README's families table with:\n{readme_table()}"
