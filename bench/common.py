"""What the benches share: their command line (the bench's docstring as its help), the markdown
table each prints, the JSON it keeps, and SP ranks spawned over one gloo file store. A bench
runs from a checkout (`python bench/NAME.py`), which this puts on the path, so it measures
the checkout's slurm_autosp whether or not it is installed."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """The bench's arguments, `--help` printing its docstring as written."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def markdown_table(
    header: Sequence[str], rows: Iterable[Sequence[object]], right: Sequence[int] = ()
) -> str:
    """A markdown table; the columns numbered in `right` align right (figures)."""
    rule = ["---:" if i in right else "---" for i in range(len(header))]
    lines = [header, rule, *([str(cell) for cell in row] for row in rows)]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def write_json(path: str | Path, results: Any) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def spawn_ranks(rank_main: Callable[..., None], args: tuple, nprocs: int) -> list[Any]:
    """Call `rank_main(rank, init_file, *args, out)` on `nprocs` spawned ranks, each of which
    writes its JSON result to f"{out}.{rank}"; return those results in rank order. The ranks
    compile into fresh private caches (inductor's and Triton's), so no run times another's
    cached graphs. torch is imported here, not with this module: a spawned rank imports its
    bench's module before `rank_main` limits its threads, which torch reads as it loads."""
    import torch.multiprocessing as mp

    from slurm_autosp.cluster.compile_cache import use_private_compile_cache

    with tempfile.TemporaryDirectory() as tmp:
        use_private_compile_cache(os.path.join(tmp, "cache"), inherited={})
        out = os.path.join(tmp, "rows")
        mp.spawn(rank_main, args=(os.path.join(tmp, "store"), *args, out), nprocs=nprocs)
        return [json.loads(open(f"{out}.{rank}").read()) for rank in range(nprocs)]
