"""The pages name only what exists: docs/configuration.md's reference is the one the schema's
docstrings render, every config key has its docstring, and every `section.key`, repository
path, `module:function` and command that README.md or a page under docs/ names is in the code."""

import re
from pathlib import Path

from slurm_autosp.commands.console import COMMANDS
from slurm_autosp.config import reference
from slurm_autosp.config.reference import COMMAND, PAGE, TOP_LEVEL

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "slurm_autosp"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# A key's fields: a section's keys, and the nested names a mapping key takes (`cluster.env.X`,
# `model.extra.X`: any). `model.X` must be a ModelConfig field too, the schema refuses others:
# Hugging Face fields it does not declare go under `model.extra`.
KEYS = {
    section: {f.name: f.default_factory is dict for f in fields}
    for section, _, fields in reference.sections()
    if section != TOP_LEVEL
}
# `train.tokens`, `model.safetensors`, `train.documents.npy`, `data.md`: files, not keys
FILE_SUFFIXES = {"py", "json", "npy", "safetensors", "tokens", "yaml", "md"}
# not a call in code (`model.generate(...)`)
KEY = re.compile(rf"(?<![\w./$-])({'|'.join(KEYS)})((?:\.\w+)+)(?![\w(])")
REFUSED_EXAMPLES = {"train.stepz"}  # docs/configuration.md: how an unknown key is refused

# Paths from the repository's root, which start with one of its own top-level folders (not a
# run directory, a user's data or an example elsewhere), and paths from the package's root
# that name a module or a subpackage (`config/load.py`, `memory_plan/`).
TOP_FOLDERS = ["slurm_autosp", "tests", "bench", "configs", "sbatch", "tools", "docs", ".ci"]
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
PATH = re.compile(
    rf"(?<![\w./$<>-])(?:({'|'.join(map(re.escape, TOP_FOLDERS))})/(?:[\w./-]*[\w/])?"
    rf"|({'|'.join(SUBPACKAGES)})/(?:[\w/]*\.py|(?:\w+/)*(?!\w)))(?::(\w+))?"
)
# `95e5193:tests/compile/sharding_cases.py`: a file at a commit (git's REV:PATH), gone since
AT_COMMIT = re.compile(r"\b[0-9a-f]{7,40}:[\w./-]+")
# `admission.py:admit`: a package module by its `module:function` name (docs/refusals.md)
MODULE_FUNCTION = re.compile(r"(?<![\w./-])(\w+\.py):(\w+)")
COMMAND_NAME = re.compile(r"(?:python -m slurm_autosp|slurm-autosp) +([a-z][\w-]*)")
MODULE = re.compile(r"(?<![\w.])slurm_autosp(?:\.\w+)+")  # run by `python -m` or imported


def texts() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for p in PAGES}


def test_the_reference_is_what_the_schema_renders():
    page = PAGE.read_text()
    assert reference.generated_part(page) == reference.render(), (
        f"docs/configuration.md's reference is stale: run `{COMMAND}`"
    )


def test_every_key_has_its_docstring():
    docs = reference.field_docstrings()
    missing = [
        f"{cls.__name__}.{f.name} ({section})"
        for section, cls, fields in reference.sections()
        for f in fields
        if not docs[cls.__name__].get(f.name)
    ]
    assert not missing, f"fields without a docstring under them in config/schema.py: {missing}"


def test_file_suffixes_are_no_keys():
    clashes = FILE_SUFFIXES & ({*KEYS} | {key for keys in KEYS.values() for key in keys})
    assert not clashes, f"the key check would pass over {clashes} as file names"


def stale_key(section: str, dotted: str) -> bool:
    names = dotted.lstrip(".").split(".")
    if names[-1] in FILE_SUFFIXES or names == ["*"]:
        return False
    subsection = f"{section}.{names[0]}"  # model.lora.rank
    if subsection in KEYS and len(names) > 1:
        return stale_key(subsection, "." + ".".join(names[1:]))
    nested = KEYS[section].get(names[0])
    return nested is None or (len(names) > 1 and not nested)


def test_every_config_key_a_page_names_exists():
    stale = [
        f"{name}: {section}{dotted}"
        for name, text in texts().items()
        for section, dotted in KEY.findall(text)
        if stale_key(section, dotted) and section + dotted not in REFUSED_EXAMPLES
    ]
    assert not stale, f"keys the schema does not have: {stale}"


def defines(path: Path, name: str) -> bool:
    return bool(
        re.search(rf"^\s*(?:(?:async )?def|class) {name}\b|^{name}\b", path.read_text(), re.M)
    )


def test_every_path_a_page_names_exists():
    stale = []
    for name, text in texts().items():
        for match in PATH.finditer(AT_COMMIT.sub("", text)):
            top, _, function = match.groups()
            path = (REPO if top else PACKAGE) / match.group(0).split(":")[0]
            if not path.exists():
                stale.append(f"{name}: {match.group(0)}")
            elif function and not defines(path, function):
                stale.append(f"{name}: {match.group(0)} (no {function} there)")
        for module, function in MODULE_FUNCTION.findall(text):
            path = PACKAGE / module
            if not path.exists() or not defines(path, function):
                stale.append(f"{name}: {module}:{function}")
    assert not stale, f"paths the repository does not have: {stale}"


def is_module(dotted: str) -> bool:
    path = REPO.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_every_command_and_module_a_page_names_exists():
    stale = [
        f"{name}: {command}"
        for name, text in texts().items()
        for command in COMMAND_NAME.findall(text)
        if command not in COMMANDS
    ]
    stale += [
        f"{name}: {module}"
        for name, text in texts().items()
        for module in MODULE.findall(text)
        if not is_module(module)
    ]
    assert not stale, f"commands the CLI does not offer, modules the package does not have: {stale}"
