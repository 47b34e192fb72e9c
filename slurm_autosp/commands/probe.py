"""python -m slurm_autosp probe cfg=CONFIG.yaml [probe.steps=5] [probe.layers=N] [key=value ...]

Probe the nodes before the long job: submitted exactly like `slurm_autosp.submit` (SLURM or
local processes, the same layout, collective environment and plan), into its own run directory
<run.output_root>/<run.name>_probe/, so it never touches the real run's checkpoints or lock.
Its signal delay is not held to a step and a save (it saves nothing): the step it measures,
recorded as step_time.json there, is what the real run's submit holds the run's delay to until
the run records its own.
Every rank measures:

- that its device's attention kernels are exact (packed documents, sliding windows);
- all-to-all bandwidth and latency in its SP group at this config's attention message sizes
  (q and output, k and v), under a ring the pass of a K/V block to the next ring rank, and the
  gradient reduction as the engine sends it (over the whole world, in fp32), against the
  link's nominal bandwidth where one is published;
- `probe.steps` real compiled training steps (the first compiles) at the configured width and
  sequence length; `probe.layers=N` scales the depth (and the plan) to N layers: step time,
  tokens/s, MFU, compile time, and memory per rank beside the plan's prediction.

Rank 0 prints a table and a verdict (plan within ±10%, bandwidth within 70% of nominal, the
slowest rank), and writes probe.json and TensorBoard events in the probe's run directory:

  python -m slurm_autosp probe cfg=configs/tiny_cpu.yaml
  python -m slurm_autosp probe cfg=configs/llama70b_128k.yaml probe.layers=4 probe.steps=3
"""

from __future__ import annotations

from slurm_autosp.commands.arguments import arguments, config_error, take_flag
from slurm_autosp.config import ConfigError, load_config, with_default_config
from slurm_autosp.launch.submission import submit
from slurm_autosp.probe.probe_job import ProbeJob, probe_config


def main(argv: list[str] | None = None) -> int:
    argv = arguments(argv, __doc__)
    if argv is None:
        return 0
    settings, force = take_flag(argv, "--force")
    try:
        return submit(
            probe_config(load_config(with_default_config(settings))), force, job_type=ProbeJob
        )
    except ConfigError as err:
        return config_error(err)
