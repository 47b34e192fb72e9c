"""A run whose first start froze choices no plan would make now, written where a requeued
start reads them (`<run dir>/config.yaml`), and those choices: a requeue must train with them."""

from pathlib import Path

from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
from slurm_autosp.config import ActivationCheckpointing, StopAt, load_config, to_yaml
from slurm_autosp.memory_plan import TrainingChoices

FROZEN = TrainingChoices(
    3,
    ActivationCheckpointSpec(ActivationCheckpointing.sac, budget=0.5),
    1024,
    True,
    True,
    False,
    StopAt.step,
    0,
)


def record_first_start(cfg: str, output_root: Path) -> None:
    first = load_config(
        [
            cfg,
            f"run.output_root={output_root}",
            "parallel.zero_stage=3",
            "compile.activation_checkpointing=sac",
            "compile.activation_memory_budget=0.5",
            "compile.tile_tokens=1024",
            "compile.offload_activations=true",
            "parallel.offload_optimizer=true",
            "checkpoint.async_save=false",
            "cluster.stop_at=step",
            "checkpoint.every_steps=0",
        ]
    )
    first.run.dir.mkdir(parents=True)
    (first.run.dir / "config.yaml").write_text(to_yaml(first))
