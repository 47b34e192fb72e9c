"""What a stop signal costs a run, decided from its step: where the step in flight ends (at the
next decoder-layer boundary when steps are long: lifecycle/layer_stops.py), and how often
saves come (every step when a step is long beside an asynchronous save, so that a signal
loses at most the step in flight)."""

from __future__ import annotations

from dataclasses import dataclass

from slurm_autosp.config import JobConfig, StopAt

# a step longer than this outlasts the shortest GraceTime sites give a preempted job
LAYER_STOP_MIN_STEP_S = 30.0
# how fast a save is staged into node memory (device to host, serialised): a low guess, so a
# save every step is chosen only where its stall is small beside the step
STAGING_GB_PER_S = 1.0
# a save every step when its stall is at most this share of a step
STALL_SHARE = 0.1


@dataclass(frozen=True)
class Stopping:
    stop_at_layers: bool  # cluster.stop_at
    save_every_steps: int  # checkpoint.every_steps; 0: no periodic saves


def stopping_for(cfg: JobConfig, step_s: float, save_bytes: float, asynchronous: bool) -> Stopping:
    """`step_s`: the step (measured or estimated); `save_bytes`: what the rank saving the most
    writes; `asynchronous`: whether saves are staged. What the config sets wins."""
    stop_at = cfg.cluster.stop_at
    layer_boundaries = not cfg.compile.enabled or cfg.compile.per_layer
    layers = stop_at is StopAt.layer or (
        stop_at is None and layer_boundaries and step_s >= LAYER_STOP_MIN_STEP_S
    )
    every = cfg.checkpoint.every_steps
    if every is None:
        stall_s = save_bytes / (STAGING_GB_PER_S * 1e9)
        write_s = save_bytes / (cfg.checkpoint.write_gb_per_s * 1e9)
        every = int(asynchronous and step_s >= max(stall_s / STALL_SHARE, write_s))
    return Stopping(layers, every)


def configured_stopping(cfg: JobConfig) -> Stopping:
    """Without a plan (CPU ranks, builder models): step boundaries and no periodic saves unless
    configured."""
    return Stopping(cfg.cluster.stop_at is StopAt.layer, cfg.checkpoint.every_steps or 0)
