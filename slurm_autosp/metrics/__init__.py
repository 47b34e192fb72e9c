"""What a run shows in TensorBoard: per-step scalars (loss, throughput, MFU, step-time split,
memory over ranks), run text (config, layout, environment) and memory traces of chosen steps
and ranks. `StepTracer` is what the training loop uses; `python -m slurm_autosp summary RUN_DIR`
summarises a run in the terminal."""

from slurm_autosp.metrics.tracer import UNTIMED, PhaseClock, Phases, StepTracer

__all__ = ["UNTIMED", "PhaseClock", "Phases", "StepTracer"]
