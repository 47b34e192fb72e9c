"""What a stop signal costs a run, decided from its step: where the step in flight ends (at the
next decoder-layer boundary when steps are long: lifecycle/layer_stops.py), and how often
saves come (every step when a step is long beside an asynchronous save, so that a signal
loses at most the step in flight).

`cluster.stop_at` null resolves to `layer` where the step (measured, or estimated) is long (a
quarter of cluster.signal_delay_s or more), to `step` where no layer can be stopped at (one
graph for the whole model), and otherwise stays null: training then stops at step ends until a
step it measures is long, and at layers from then on, as an estimate may be wrong and CPU jobs
have none."""

from __future__ import annotations

from dataclasses import dataclass

from slurm_autosp.config import JobConfig, StopAt
from slurm_autosp.lifecycle.layer_stops import long_step_s

# how fast a save is staged into node memory (device to host, serialised): a low guess, so a
# save every step is chosen only where its stall is small beside the step
STAGING_GB_PER_S = 1.0
# a save every step when its stall is at most this share of a step
STALL_SHARE = 0.1


@dataclass(frozen=True)
class Stopping:
    stop_at: StopAt | None  # cluster.stop_at; None: layers once a measured step is long
    save_every_steps: int  # checkpoint.every_steps; 0: no periodic saves


def stopping_for(cfg: JobConfig, step_s: float, save_bytes: float, asynchronous: bool) -> Stopping:
    """`step_s`: the step (measured or estimated); `save_bytes`: what the rank saving the most
    writes; `asynchronous`: whether saves are staged. What the config sets wins."""
    stop_at = _unmeasured_stop_at(cfg)
    if stop_at is None and step_s >= long_step_s(cfg.cluster.signal_delay_s):
        stop_at = StopAt.layer
    every = cfg.checkpoint.every_steps
    if every is None:
        stall_s = save_bytes / (STAGING_GB_PER_S * 1e9)
        write_s = save_bytes / (cfg.checkpoint.write_gb_per_s * 1e9)
        every = int(asynchronous and step_s >= max(stall_s / STALL_SHARE, write_s))
    return Stopping(stop_at, every)


def configured_stopping(cfg: JobConfig) -> Stopping:
    """Without a plan (CPU ranks, builder models): no step to estimate, and no periodic saves
    unless configured."""
    return Stopping(_unmeasured_stop_at(cfg), cfg.checkpoint.every_steps or 0)


def _unmeasured_stop_at(cfg: JobConfig) -> StopAt | None:
    """cluster.stop_at before any step is known: null stays null unless the model is compiled
    as one graph, with no layer boundary to stop at."""
    one_graph = cfg.compile.enabled and not cfg.compile.per_layer
    return StopAt.step if cfg.cluster.stop_at is None and one_graph else cfg.cluster.stop_at
