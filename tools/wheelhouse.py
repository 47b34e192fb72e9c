"""Write a wheelhouse for an offline install: `./install.sh --download DIR` runs this.

The wheelhouse holds the versions installed (and tested) here: the closure of slurm_autosp's
requirements, read from this environment's package metadata with the markers evaluated for the
target's Python, each downloaded as a wheel for that Python, DeepSpeed and slurm_autosp built
here as pure-Python wheels (DeepSpeed's ops are left to build just in time on the target).
`--no-torch` leaves out torch and what torch requires (the target keeps its own torch);
`--have FILE` leaves out every package the target already has in a version that satisfies
what requires it (FILE: `python -m pip freeze` run there); `--extra view` adds an extra's
packages (TensorBoard and matplotlib, to look at results there); `--max-mib N` fails when the
wheelhouse is larger (a transfer's limit).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = "slurm_autosp"
BUILT_HERE = ("deepspeed", "slurm-autosp")  # no wheel on the index: built from source here


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Needed:
    """A package of the closure: its version here and what its dependents ask of it."""

    version: str
    wanted: SpecifierSet = field(default_factory=SpecifierSet)


def closure(root: str, python: str, have: dict[str, Version], skip: set[str]) -> dict[str, Needed]:
    """Every package `root` needs on a target with Python `python`, at the version installed
    here, but those in `skip` and those the target `have`s in a version every dependent
    accepts (whose own requirements are then the target's)."""
    environment = {"python_version": python, "python_full_version": f"{python}.0"}
    needed: dict[str, Needed] = {}
    expanded: set[tuple[str, str]] = set()  # a package, with one of its extras or none ("")
    pending = [Requirement(root)]
    while pending:
        requirement = pending.pop()
        name = normalized(requirement.name)
        if name in skip:
            continue
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            raise SystemExit(
                f"{requirement.name} (required as '{requirement}') is not installed here: the "
                "wheelhouse holds what this environment tested; run ./install.sh here first"
            ) from None
        entry = needed.setdefault(name, Needed(version))
        entry.wanted &= requirement.specifier
        if name in have and have[name] in entry.wanted:
            continue
        for extra in {"", *requirement.extras} - {e for n, e in expanded if n == name}:
            expanded.add((name, extra))
            for line in metadata.requires(requirement.name) or []:
                dependency = Requirement(line)
                marker = dependency.marker
                if marker is None or marker.evaluate({**environment, "extra": extra}):
                    pending.append(dependency)
    return {
        name: entry
        for name, entry in needed.items()
        if not (name in have and have[name] in entry.wanted)
    }


def frozen(path: Path | None) -> dict[str, Version]:
    """A `pip freeze` listing: name -> version (lines of other forms are skipped)."""
    if path is None:
        return {}
    found = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and name and not name.startswith("-"):
            found[normalized(name)] = Version(version)
    return found


def torch_closure(python: str) -> set[str]:
    return set(closure("torch", python, {}, set()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--no-torch", action="store_true", help="the target keeps its own torch")
    parser.add_argument(
        "--python-version",
        default=f"{sys.version_info.major}.{sys.version_info.minor}",
        help="the target's Python, e.g. 3.12 (default: this one's)",
    )
    parser.add_argument("--have", type=Path, help="`python -m pip freeze` of the target")
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        help="an extra of slurm_autosp to include, e.g. view (repeatable)",
    )
    parser.add_argument(
        "--max-mib", type=float, help="fail (exit 1) when the wheelhouse is larger than this"
    )
    args = parser.parse_args()
    skip = torch_closure(args.python_version) if args.no_torch else set()
    root = f"{ROOT}[{','.join(args.extra)}]" if args.extra else ROOT
    needed = closure(root, args.python_version, frozen(args.have), skip)
    args.directory.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={entry.version}" for name, entry in sorted(needed.items())]
    downloaded = [pin for pin in pins if pin.partition("==")[0] not in BUILT_HERE]
    if downloaded:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        subprocess.run(
            [*pip, "--python-version", args.python_version, "-d", str(args.directory), *downloaded],
            check=True,
        )
    built = {name: needed[name].version for name in BUILT_HERE if name in needed}
    if "deepspeed" in built:  # its ops left to build just in time, against the target's torch
        build(f"deepspeed=={built['deepspeed']}", args.directory, {"DS_BUILD_OPS": "0"})
    if normalized(ROOT) in built:
        build(str(Path(__file__).resolve().parents[1]), args.directory, {})
    size = sum(p.stat().st_size for p in args.directory.glob("*.whl"))
    print(
        f"wheelhouse {args.directory}: {len(needed)} packages for Python {args.python_version}"
        f"{' without torch' if args.no_torch else ''}, {size / 2**20:.1f} MiB"
    )
    if args.max_mib is not None and (refused := over_limit(args.directory, args.max_mib)):
        raise SystemExit(refused)


def over_limit(directory: Path, max_mib: float) -> str | None:
    """Why the wheels in `directory` exceed `max_mib` MiB (naming the largest), or None."""
    wheels = sorted(directory.glob("*.whl"), key=lambda p: -p.stat().st_size)
    size = sum(p.stat().st_size for p in wheels) / 2**20
    if size <= max_mib:
        return None
    largest = ", ".join(
        f"{'-'.join(p.name.split('-')[:2])} {p.stat().st_size / 2**20:.1f}" for p in wheels[:5]
    )
    return (
        f"error: wheelhouse {directory} is {size:.1f} MiB, over the limit of {max_mib:g} MiB; "
        f"largest wheels (MiB): {largest}"
    )


def build(source: str, into: Path, env: dict[str, str]) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(into), source],
        check=True,
        env={**os.environ, **env},
    )


if __name__ == "__main__":
    main()
