"""python -m slurm_autosp.probe cfg=CONFIG.yaml [probe.steps=5] [probe.layers=N] [key=value ...]

Probe the nodes before the long job: submitted exactly like `slurm_autosp.submit` (SLURM or
local processes, the same layout, collective environment and plan), into its own run directory
<run.output_root>/<run.name>_probe/, so it never touches the real run's checkpoints or lock.
Every rank measures:

- all-to-all bandwidth and latency in its SP group at this config's attention message sizes
  (q and output, k and v), and all-reduce and reduce-scatter in its DP group at the gradient
  reduction's size, against the link's nominal bandwidth where one is published;
- `probe.steps` real compiled training steps (the first compiles) at the configured width and
  sequence length; `probe.layers=N` scales the depth (and the plan) to N layers: step time,
  tokens/s, MFU, compile time, and memory per rank beside the plan's prediction.

Rank 0 prints a table and a verdict (plan within ±10%, bandwidth within 70% of nominal, the
slowest rank), and writes probe.json and TensorBoard events in the probe's run directory:

  python -m slurm_autosp.probe cfg=configs/tiny_cpu.yaml
  python -m slurm_autosp.probe cfg=configs/llama70b_128k.yaml probe.layers=4 probe.steps=3
"""

from __future__ import annotations

import sys

from slurm_autosp import submit
from slurm_autosp.cli import arguments, config_error, take_flag
from slurm_autosp.config import ConfigError, JobConfig, load_config
from slurm_autosp.probe.job import ProbeJob


def probe_overrides(cfg: JobConfig) -> list[str]:
    """The probe's own run directory, and the depth it scales the model (and the plan) to."""
    overrides = [f"run.name={cfg.run.name}_probe"]
    if cfg.probe.layers is not None:
        overrides.append(f"model.num_hidden_layers={cfg.probe.layers}")
    return overrides


def main(argv: list[str] | None = None) -> int:
    argv = arguments(argv, __doc__)
    if argv is None:
        return 0
    settings, _ = take_flag(argv, "--force")
    try:
        cfg = load_config(settings)
    except ConfigError as err:
        return config_error(err)
    return submit.main([*argv, *probe_overrides(cfg)], job_type=ProbeJob)


if __name__ == "__main__":
    sys.exit(main())
