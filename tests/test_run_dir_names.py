"""A run directory's entries are named in lifecycle/run_dir.py alone (`RunDir`): a module that
joins one of the names onto a path itself would let the layout that `status`, `summary`, a
resumed job and users' scripts rely on drift apart."""

import ast
from pathlib import Path

from slurm_autosp.lifecycle.run_dir import RunDir

PACKAGE = Path(__file__).resolve().parent.parent / "slurm_autosp"
OWNER = Path("lifecycle", "run_dir.py")
NAMES = {
    "config.yaml",
    "configs",
    "submitit",
    "checkpoints",
    "hf",
    ".hf.partial",
    ".hf.previous",
    "adapter",
    ".adapter.partial",
    ".adapter.previous",
    "tensorboard",
    "memory",
    "flight_recorder",
    "job.lock",
    "requeues.jsonl",
    "probe.json",
    "step_time.json",
    "outside_allocator.json",
}
JOINS = {"join", "joinpath", "with_name"}  # os.path.join, Path.joinpath, Path.with_name


def _names(nodes: list[ast.expr]) -> list[str]:
    return [n.value for n in nodes if isinstance(n, ast.Constant) and n.value in NAMES]


def spelled_run_dir_paths(package: Path) -> list[str]:
    """Each place outside run_dir.py that builds a path from a run directory entry's name:
    `x / "name"`, `os.path.join(x, "name")`, `x.with_name("name")`, `x.name == "name"`, or
    keeps the name to join later (`LOCK = "name"`)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package) == OWNER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                names = _names([node.left, node.right])
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in JOINS:
                names = _names(node.args)
            elif isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                by_name = any(getattr(n, "attr", None) == "name" for n in sides)
                names = _names(sides) if by_name else []
            elif isinstance(node, ast.Assign):
                names = _names([node.value])
            else:
                continue
            where = f"{path.relative_to(package.parent)}:{node.lineno}"
            found += [f"{where} spells {name!r}" for name in names]
    return found


def test_only_run_dir_py_names_what_a_run_directory_holds():
    spelled = spelled_run_dir_paths(PACKAGE)
    assert not spelled, "use RunDir:\n" + "\n".join(spelled)


def test_every_name_checked_is_one_run_dir_gives():
    """The names above stay those RunDir gives: a renamed entry is not silently unchecked."""
    run = RunDir(Path("/run"))
    given = {
        part
        for p in (
            run.config,
            run.earlier_config(1),
            run.submitit,
            run.checkpoints,
            run.hf_export,
            run.hf_export_partial,
            run.hf_export_previous,
            run.adapter_export,
            run.adapter_export_partial,
            run.adapter_export_previous,
            run.memory_traces,
            run.flight_recorder_prefix,
            run.lock,
            run.requeues,
            run.probe_report,
            run.step_time,
            run.outside_allocator,
        )
        for part in p.relative_to(run.root).parts
    }
    assert NAMES <= given
