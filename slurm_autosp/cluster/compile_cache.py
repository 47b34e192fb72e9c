"""Where inductor and Triton keep compiled code, for every process that compiles: the job's
ranks, verify's ranks, the plan's tracing and the benches.

Inductor unpickles what it finds in its cache, so a directory another user owns or can write
could run their code in ours. torch's own default, /tmp/torchinductor_<user>, is a name any
user of the machine can create first; the directories used here are created 0700 and checked.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from slurm_autosp.cluster.comm_env import compile_cache_settings
from slurm_autosp.compat import torch_api
from slurm_autosp.config import ConfigError

CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def users_environment(inherited: Mapping[str, str]) -> dict[str, str]:
    """`inherited` less a TORCHINDUCTOR_CACHE_DIR equal to torch's default: importing
    torch._dynamo exports it (in the submitting process too, whose environment the job
    inherits), so it is not the user's choice."""
    environment = dict(inherited)
    if environment.get("TORCHINDUCTOR_CACHE_DIR") == torch_api.inductor_default_cache_dir():
        del environment["TORCHINDUCTOR_CACHE_DIR"]
    return environment


def compile_cache_env(cache_dir: str | None, inherited: Mapping[str, str]) -> dict[str, str]:
    """TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR: the user's own values, else under
    `cache_dir` (compile.cache_dir), else under the node-local default (comm_env)."""
    user = users_environment(inherited)
    return {s.name: user.get(s.name, s.value) for s in compile_cache_settings(user, cache_dir)}


def private_cache_dir(path: str) -> None:
    """Make `path` (and its parent) this user's alone, or refuse it. A sticky parent (/tmp) is
    safe: others cannot replace `path` there."""
    parent = os.path.dirname(path)
    for directory in (parent, path):
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as err:
            raise ConfigError(
                f"compile cache directory {directory}: cannot create it ({err.strerror}); set "
                "compile.cache_dir (or TORCHINDUCTOR_CACHE_DIR) to a directory of your own here"
            ) from err
        info = os.stat(directory)
        sticky_parent = directory == parent and info.st_mode & stat.S_ISVTX
        if not sticky_parent and (info.st_uid != os.getuid() or info.st_mode & 0o022):
            raise ConfigError(
                f"compile cache directory {directory} is owned by uid {info.st_uid} or writable by others "
                f"(mode {info.st_mode & 0o777:o}); compiled code is loaded from it: remove it, or set "
                "compile.cache_dir to a directory of your own"
            )


def use_private_compile_cache(
    cache_dir: str | None, inherited: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Set up the compile caches of this process and of the processes it starts: every
    command calls this before it compiles. The directories (`compile_cache_env` of `inherited`,
    default this process's environment) are checked to be this user's alone, then exported."""
    env = compile_cache_env(cache_dir, os.environ if inherited is None else inherited)
    for path in env.values():
        private_cache_dir(path)
    os.environ.update(env)
    return env


@contextmanager
def private_compile_cache() -> Iterator[dict[str, str]]:
    """The node-local (or the user's own) private caches for a block, the environment restored
    after it: the plan traces with Dynamo in the submitting process, whose environment its job
    inherits (sbatch exports it) on nodes with another temporary directory."""
    saved = {name: os.environ.get(name) for name in CACHE_VARIABLES}
    try:
        yield use_private_compile_cache(None)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
