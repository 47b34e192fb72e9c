"""The dependency order holds, one floor a package where packages depend on each other:
config -> cluster -> run lifecycle -> SP runtime -> compiler -> data and model -> the model's refusals -> training
state -> engines -> the step runner -> memory plan -> admission -> evaluation and verify -> train -> launch -> the probe
-> the GPU check -> the commands -> the names they are run by (`python -m slurm_autosp.submit`,
each package's __main__). No module imports one of a later layer, or another package of its own layer, at
the top or inside a function: no two packages import each other."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "slurm_autosp"

LAYERS = [
    {"heads", "compat"},
    {"config"},
    {"cluster"},
    {"lifecycle"},
    {"sp"},
    {"compile"},
    {"lora"},
    {"data", "model", "optim", "metrics"},
    {"model_refusals"},
    {"checkpoint"},
    {"engine"},
    {"run_step"},
    {"memory_plan"},
    {"admission"},
    {"evaluate", "verify"},
    {"train"},
    {"launch"},
    {"probe"},
    {"gpu_check"},
    {"commands"},
    {"submit", "run", "__main__"},
]
LAYER = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _top(module: str) -> str:
    return module.split(".")[1]


def test_every_module_has_a_layer():
    names = {
        p.name.removesuffix(".py")
        for p in PACKAGE.iterdir()
        if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())
    }
    assert names <= set(LAYER), f"place {sorted(names - set(LAYER))} in LAYERS"


def test_no_module_imports_a_later_layer():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if own == "__init__":
            continue
        rank = len(LAYERS) - 1 if path.name == "__main__.py" else LAYER[own]  # a command
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "slurm_autosp":
                modules = [f"slurm_autosp.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "slurm_autosp."
            ):
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names if a.name.startswith("slurm_autosp.")]
            else:
                continue
            upward += [
                f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {m}"
                for m in modules
                if LAYER[_top(m)] > rank or (LAYER[_top(m)] == rank and _top(m) != own)
            ]
    assert not upward, "\n".join(upward)
