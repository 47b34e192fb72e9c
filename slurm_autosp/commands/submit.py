"""python -m slurm_autosp.submit cfg=CONFIG.yaml [key=value ...]

Submit a training job: sbatch on a SLURM cluster, local processes elsewhere. Without
cfg=, it trains configs/tiny_cpu.yaml: a tiny Llama on 2 local CPU ranks, about a minute. The memory plan's
choices (ZeRO stage, checkpointing, tiling, offload) are written into the run's config: every
start and requeue of the job trains with them.

  python -m slurm_autosp.submit cfg=configs/tiny_cpu.yaml train.steps=50
  python -m slurm_autosp.submit cfg=configs/llama70b_128k.yaml cluster.nodes=8 dry_run=true

On SLURM, submit returns once the job is queued and prints how to follow it (follow=true
streams rank 0's log instead; Ctrl-C then detaches, the job runs on); local jobs are followed
until they end (Ctrl-C cancels them).

One job trains a run at a time: a run held by a live job is refused. --force takes over a run
whose job cannot be checked (the SLURM controller does not answer), once you know it is gone.

Every key of the config can be overridden as section.key=value (e.g. parallel.sp_size=4,
cluster.backend=local). The run's directory <run.output_root>/<run.name>/ receives the
resolved config (config.yaml; earlier submissions' in configs/), per-rank logs, checkpoints
and TensorBoard events:

  tensorboard --logdir <run.output_root>/<run.name>/tensorboard
"""

from __future__ import annotations

from slurm_autosp.commands.arguments import arguments, config_error, take_flag
from slurm_autosp.config import ConfigError, load_config, with_default_config
from slurm_autosp.launch.submission import submit


def main(argv: list[str] | None = None) -> int:
    argv = arguments(argv, __doc__)
    if argv is None:
        return 0
    argv, force = take_flag(argv, "--force")
    try:
        return submit(load_config(with_default_config(argv)), force)
    except ConfigError as err:
        return config_error(err)
