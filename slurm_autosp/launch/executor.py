"""The submitit executor for a job: sbatch on a SLURM cluster, local processes elsewhere."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Mapping
from typing import Any

import submitit

from slurm_autosp.compat import submitit_api
from slurm_autosp.config import Backend, ClusterConfig, ConfigError, JobConfig
from slurm_autosp.lifecycle.run_dir import RunDir

SLURM_TOOLS = ("sbatch", "srun")


def slurm_reachable() -> bool:
    """A controller answers: installed client tools alone do not make a cluster."""
    if shutil.which("sbatch") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def resolve_backend(backend: Backend) -> Backend:
    if backend is Backend.auto:
        return Backend.slurm if slurm_reachable() else Backend.local
    return backend


def build_executor(cfg: JobConfig, backend: Backend) -> submitit.AutoExecutor:
    """The executor that submits the job on the resolved `backend` (never auto)."""
    if backend is Backend.slurm:
        _require_slurm_tools()
    else:
        _let_local_jobs_be_cancelled()
    executor = submitit.AutoExecutor(folder=RunDir(cfg.run.dir).submitit, cluster=backend.value)
    slurm = {f"slurm_{k}": v for k, v in _slurm_parameters(cfg.cluster).items()}
    executor.update_parameters(**_shared_parameters(cfg), **slurm)
    if backend is Backend.local and cfg.cluster.uses_gpus:
        submitit_api.show_local_gpus(executor, local_gpus(cfg.cluster, os.environ))
    return executor


def local_gpus(c: ClusterConfig, inherited: Mapping[str, str]) -> tuple[int, ...]:
    """The GPUs a local job's ranks may use: those the submitting shell's CUDA_VISIBLE_DEVICES
    shows, in its order (submitit would otherwise show the job GPUs 0..n-1, whoever uses
    them), or the first `cluster.gpus_per_node` when it is unset."""
    shown = inherited.get("CUDA_VISIBLE_DEVICES")
    if shown is None:
        return tuple(range(c.gpus_per_node))
    try:
        gpus = tuple(int(gpu) for gpu in shown.split(",")) if shown.strip() else ()
    except ValueError as err:
        raise ConfigError(
            f"CUDA_VISIBLE_DEVICES={shown}: a local job takes its GPUs by index; name them by "
            "index (e.g. CUDA_VISIBLE_DEVICES=0,1), or unset it to use the first "
            f"cluster.gpus_per_node={c.gpus_per_node}"
        ) from err
    if len(gpus) < c.gpus_per_node:
        raise ConfigError(
            f"cluster.gpus_per_node={c.gpus_per_node} but CUDA_VISIBLE_DEVICES={shown} shows "
            f"{len(gpus)} GPU(s) to this job; show it more, or lower cluster.gpus_per_node"
        )
    return gpus[: c.gpus_per_node]


def _let_local_jobs_be_cancelled() -> None:
    """submitit cancels a local job with SIGINT to the controller process it starts, which
    then kills the ranks. A command started in the background by a shell (`cmd &`, nohup, some
    CI runners) ignores SIGINT, and an ignored signal stays ignored across exec: the
    controller would outlive a failed job, with its other ranks waiting in a collective. A
    handled signal is reset to the default by exec, so handling it here restores it there."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _require_slurm_tools() -> None:
    """Name the key to change where this machine cannot submit, instead of submitit's traceback."""
    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
    if missing:
        raise ConfigError(
            f"cluster.backend=slurm: {' and '.join(missing)} not found on PATH, so this machine cannot submit "
            "to SLURM; run on a login node of the cluster, or use cluster.backend=local (or cluster.backend=auto) "
            "to train here"
        )


def _shared_parameters(cfg: JobConfig) -> dict[str, Any]:
    """The resources in submitit's generic names, which every executor translates for itself."""
    c = cfg.cluster
    params: dict[str, Any] = dict(
        name=cfg.run.name,
        nodes=c.nodes,
        tasks_per_node=c.ranks_per_node,
        cpus_per_task=c.cpus_per_task,
        timeout_min=c.time_min,
    )
    if c.uses_gpus:
        params["gpus_per_node"] = c.gpus_per_node
    if c.mem_gb is not None:
        params["mem_gb"] = c.mem_gb
    return params


# A rank that fails ends the job step: the other ranks would otherwise wait in a collective,
# holding their GPUs, until the collective timeout. Requeues exit 0 and are not affected.
KILL_ON_BAD_EXIT = "--kill-on-bad-exit=1"


def _slurm_parameters(c: ClusterConfig) -> dict[str, Any]:
    """The SLURM-only options, in submitit's SlurmExecutor names (the local executor has none)."""
    srun_args = list(c.srun_args)
    if not any(arg.startswith(("--kill-on-bad-exit", "-K")) for arg in srun_args):
        srun_args.insert(0, KILL_ON_BAD_EXIT)
    if c.container_image:
        srun_args.append(f"--container-image={c.container_image}")
    if c.container_mounts:
        srun_args.append(f"--container-mounts={','.join(c.container_mounts)}")
    optional = {
        "partition": c.partition,
        "account": c.account,
        "qos": c.qos,
        "constraint": c.constraint,
        "exclusive": c.exclusive or None,
    }
    return {
        **{k: v for k, v in optional.items() if v is not None},
        "signal_delay_s": c.signal_delay_s,
        "setup": list(c.setup),
        "srun_args": srun_args,
        "additional_parameters": {"requeue": True, **c.sbatch_extra},
    }


class _ScriptOnlySlurmExecutor(submitit.SlurmExecutor):
    """submitit's SLURM executor without its srun check: it only renders the script, so a dry run
    can plan a cluster job on a machine without Slurm."""

    @classmethod
    def affinity(cls) -> int:
        return 2


def sbatch_script(cfg: JobConfig) -> str:
    """The exact script submitit would hand to sbatch (a dry run prints it), rendered by submitit
    from the parameters build_executor gives it, the way AutoExecutor translates them."""
    slurm = _ScriptOnlySlurmExecutor(RunDir(cfg.run.dir).submitit)
    slurm.update_parameters(
        **submitit_api.slurm_parameters(slurm, _shared_parameters(cfg)),
        **_slurm_parameters(cfg.cluster),
    )
    return submitit_api.sbatch_text(slurm, uid="dry-run")
