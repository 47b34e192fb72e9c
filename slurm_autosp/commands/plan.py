"""python -m slurm_autosp plan cfg=CONFIG.yaml [key=value ...]

Print the per-GPU memory plan of a job (parameters, gradients, optimizer shard, gathered
weights under ZeRO-3, activations, logits/loss buffers, communication and recompute working
buffers, fragmentation margin) against its GPU, the ZeRO stage and checkpointing policy it
trains with (chosen here when the config leaves them to the plan), the longest sequence each
policy fits on this cluster shape under ZeRO-1 and ZeRO-3, and the verdict. Exits 0 when the
job fits, and 2 when submit would refuse it: it does not fit, or its config is refused
(docs/refusals.md).

  python -m slurm_autosp plan cfg=configs/llama8b_32k.yaml
  python -m slurm_autosp plan cfg=configs/llama70b_128k.yaml parallel.sp_size=8
"""

from __future__ import annotations

import logging
import sys
import warnings
from dataclasses import replace

from slurm_autosp.admission import admit_model
from slurm_autosp.commands.arguments import REFUSED, arguments, config_error
from slurm_autosp.config import ConfigError, load_config, with_default_config
from slurm_autosp.memory_plan import build_plan, render, verdict


def main(argv: list[str] | None = None) -> int:
    """Whether the job fits: only the model's admission applies (a plan means nothing for a
    model AutoSP computes wrongly); absent data or another run's checkpoint do not change the
    answer, so they are left to submit."""
    argv = arguments(argv, __doc__)
    if argv is None:
        return 0
    try:
        cfg = load_config(with_default_config(argv))
        admit_model(cfg)
    except ConfigError as err:
        return config_error(err)
    warnings.filterwarnings("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
    if not cfg.cluster.uses_gpus:  # plan as if each rank had a GPU
        cfg = replace(cfg, cluster=replace(cfg.cluster, gpus_per_node=cfg.cluster.ranks_per_node))
        print(
            f"(CPU config: planned as {cfg.cluster.gpus_per_node} GPUs per node of {cfg.cluster.gpu_memory_gb:g} GB)"
        )
    plan = build_plan(cfg)
    print(render(plan))
    _, fits, reason = verdict(plan)
    if fits:
        return 0
    print(f"error: {reason}", file=sys.stderr)  # submit's refusal, with the same exit status
    return REFUSED
