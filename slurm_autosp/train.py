"""The training loop: short enough to read in one sitting; components do the work."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from slurm_autosp.checkpoint.async_save import CheckpointSaves
from slurm_autosp.checkpoint.export import export_run, exported_names
from slurm_autosp.checkpoint.identity import run_settings
from slurm_autosp.checkpoint.store import (
    CheckpointStore,
    TrainerState,
    damage_report,
    rng_state,
    set_rng_state,
)
from slurm_autosp.cluster.parallel_dims import ParallelDims
from slurm_autosp.compile import AutoSPBackend, compile_model, decoder_layers, tile_mlps
from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
from slurm_autosp.config import CompileConfig, JobConfig, StopAt
from slurm_autosp.data import build_source, micro_batch, prepared_tokenizer
from slurm_autosp.engine import TrainEngine, build_engine
from slurm_autosp.evaluate import build_evaluator
from slurm_autosp.lifecycle.layer_stops import LayerStops, StepInterrupted, long_step_s
from slurm_autosp.lifecycle.lock import RunLock, this_process
from slurm_autosp.lifecycle.requeue import requeue_and_exit
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.lifecycle.save_schedule import SaveSchedule
from slurm_autosp.lifecycle.save_time import StepTime
from slurm_autosp.lifecycle.signals import StopRequest
from slurm_autosp.memory_plan import training_choices
from slurm_autosp.metrics import UNTIMED, Phases, StepTracer
from slurm_autosp.metrics.outside_allocator import record_outside_allocator
from slurm_autosp.run_step import run_engine_step
from slurm_autosp.sp import set_sp_groups
from slurm_autosp.sp.offload import ActivationOffload
from slurm_autosp.sp.step import shard_for_rank
from slurm_autosp.verify.start_check import run_start_check

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    first_step: int  # steps done before this job started (resumed runs)
    losses: list[float]  # one per step this job ran


def compile_for_sp(
    model: torch.nn.Module,
    compile: CompileConfig,
    dims: ParallelDims,
    spec: ActivationCheckpointSpec,
    tile_tokens: int = 0,
    backend: AutoSPBackend | None = None,
) -> AutoSPBackend | None:
    """Compile the model with the AutoSP backend over this rank's SP group (if enabled): the
    all-to-alls over its Ulysses group, ring attention over its ring group (ring_size > 1),
    checkpointing activations by `spec`, its MLPs in sequence tiles of `tile_tokens` (0: untiled).
    Passing the `backend` an earlier model of the same shapes was compiled with reuses its
    graphs: Dynamo serves a graph only to the backend object that compiled it."""
    if not compile.enabled:
        if tile_tokens:
            tile_mlps(model, tile_tokens)
        return None
    backend = backend or AutoSPBackend(dims.sp_size, spec, dims.ring_size)
    log.info("AutoSP: %r%s", backend, f", MLP tiles of {tile_tokens} tokens" if tile_tokens else "")
    set_sp_groups(dims.ulysses_group, dims.ring_group)
    compile_model(model, backend, per_layer=compile.per_layer, tile_tokens=tile_tokens)
    return backend


def train(
    cfg: JobConfig,
    dims: ParallelDims,
    stop: StopRequest,
    fence: Callable[[], str] = lambda: "",
    job: RunLock | None = None,
) -> TrainResult:
    """`fence`: why this job may no longer write the run, empty while it may (asked before
    every save and commit: launch/job.py's, a later start of the job holding the run's lock).
    `job`: the start training (its staging is its own); None: this process, outside a job."""
    start_check = run_start_check(cfg, dims)  # before any state exists: raises if SP is inexact
    choices = training_choices(cfg)
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, dims.device, choices.zero_stage, choices.offload_optimizer)
    log.info(
        "engine: %s (loss factor %g%s)",
        engine.name,
        engine.loss_scale,
        "; optimizer state in host memory" if choices.offload_optimizer else "",
    )
    backend = compile_for_sp(
        engine.module, cfg.compile, dims, choices.checkpointing, choices.tile_tokens
    )
    offload = None
    if choices.offload_activations:
        offload = ActivationOffload(dims.device, layers=len(decoder_layers(engine.module)))
        log.info("activation offload: what backward keeps waits in host memory")
    source = build_source(cfg, _vocab_size(engine.module))
    evaluator = build_evaluator(cfg, dims, _vocab_size(engine.module))
    store = CheckpointStore(
        RunDir(cfg.run.dir).checkpoints,
        dims.rank,
        dims.world_size,
        cfg.checkpoint.keep,
        cfg.checkpoint.remove_damaged,
        fence=fence,
    )
    store.check_writable()
    settings = run_settings(cfg, dims.layout, choices.zero_stage)
    resumed = store.load_latest(engine, settings)
    # the store checked it is samples_consumed / global_batch
    first_step = resumed.step if resumed else 0
    saves = CheckpointSaves.start(
        store,
        choices.async_save,
        cfg.checkpoint.staging_dir,
        RunDir(cfg.run.dir).root,
        job or this_process(),
        first_step,
    )
    schedule = SaveSchedule(choices.save_every_steps, cfg.checkpoint.every_minutes)
    stops = _layer_stops(cfg, engine.module, choices.stop_at, stop)
    tracer = StepTracer(
        cfg, dims.rank, dims.world_size, dims.device, engine.module, first_step, dims.layout
    )
    if start_check is not None:
        tracer.note("run/exactness_check", start_check.line, first_step)
    if store.set_aside:
        tracer.note("run/damaged_checkpoints", damage_report(store.set_aside), first_step)
    losses = []
    try:
        for step in range(first_step, cfg.train.steps):
            lr = engine.lr()
            before = rng_state() if stops and stops.every_step else None
            try:
                with tracer.step(step + 1) as phases, stops.step() if stops else nullcontext():
                    loss = optimizer_step(engine, cfg, dims, source, step, phases, offload)
            except StepInterrupted:
                # the parameters are the previous step's: save them if storage has them not
                engine.abandon_step()
                assert before is not None
                set_rng_state(before)
                log.info("step %d abandoned at a layer boundary", step + 1)
                _, _, writing, _ = _agree(dims, False, True, saves.writing(), False)
                saves.commit_written(writing)
                if saves.newest_step != step:
                    state = _trainer_state(cfg, dims, engine, step, settings)
                    saves.save(
                        engine, state, synchronous=True, time_left=lambda: _time_left(stop, cfg)
                    )
                _stop(cfg, dims, tracer, step, stop)
            if backend is not None and step == first_step:
                backend.require_sdpa_found()
            losses.append(loss)
            done = step + 1
            tracer.log_step(done, loss, lr, engine.grad_norm())
            long_step = tracer.step_s >= long_step_s(cfg.cluster.signal_delay_s)
            save_due, stop_now, writing, long_step = _agree(
                dims, schedule.due(done), stop.requested, saves.writing(), long_step
            )
            if stops is not None and long_step and not stops.every_step:
                stops.every_step = True
                log.info(
                    "step %d took over %g s: a stop signal ends a step at its next layer "
                    "boundary from now on",
                    done,
                    long_step_s(cfg.cluster.signal_delay_s),
                )
            if step == first_step:  # every collective of a step has run once, NCCL sized them
                path = RunDir(cfg.run.dir).outside_allocator
                record_outside_allocator(path, dims, choices.zero_stage, done)
            saves.commit_written(writing)
            if evaluator is not None and evaluator.due(done):
                if stop_now:
                    log.info("evaluation at step %d skipped: stopping", done)
                else:
                    stop_now = evaluator.run(done, engine, stop, tracer.writer)
            last = stop_now or done == cfg.train.steps
            if save_due or last:
                state = _trainer_state(cfg, dims, engine, done, settings)
                stop_now |= saves.save(
                    engine,
                    state,
                    synchronous=last,
                    stopping=lambda: stop.requested,
                    time_left=lambda: _time_left(stop, cfg),
                )
                schedule.saved()
            if stop_now:
                _stop(cfg, dims, tracer, done, stop)
    finally:
        saves.close()
        tracer.close()
    tokenizer = prepared_tokenizer(cfg.data)  # before the collective: every rank or none fails
    # every rank takes each tensor: FSDP2 gathers it
    weights = engine.full_state_dict(exported_names(cfg.model.lora))
    if dims.rank == 0:
        lora, base = cfg.model.lora, cfg.model.pretrained_path
        export_run(engine.module, cfg.run.dir, weights, tokenizer, lora, base)
    else:
        for _ in weights:
            pass
    return TrainResult(first_step=first_step, losses=losses)


def _stop(
    cfg: JobConfig, dims: ParallelDims, tracer: StepTracer, done: int, stop: StopRequest
) -> NoReturn:
    log.info("stopping at step %d on %s", done, stop.signal_name or "another rank's signal")
    tracer.close()
    requeue_and_exit(cfg.run.dir, dims.rank, cfg.cluster.max_requeues)


def _layer_stops(
    cfg: JobConfig, model: torch.nn.Module, stop_at: StopAt | None, stop: StopRequest
) -> LayerStops | None:
    """Collective: boundaries at every decoder layer unless cluster.stop_at=step, armed in
    every step for `layer`; for null once a step is long (the run's recorded step counts)."""
    if stop_at is StopAt.step:
        return None
    recorded = StepTime.read(RunDir(cfg.run.dir).step_time)
    step_s = recorded.seconds if recorded else 0.0
    every_step = stop_at is StopAt.layer or step_s >= long_step_s(cfg.cluster.signal_delay_s)
    stops = LayerStops.install(decoder_layers(model), stop, every_step=every_step)
    if stops.every_step:
        why = "layer" if stop_at else f"null, the run's steps take {step_s:.0f} s"
        log.info("a stop signal ends a step at its next layer boundary (cluster.stop_at=%s)", why)
    return stops


def _time_left(stop: StopRequest, cfg: JobConfig) -> float | None:
    """Before Slurm's kill: cluster.signal_delay_s after the stop signal, as admission planned
    it (also a preemption's GraceTime); None on local processes, which nothing kills."""
    return stop.time_left(cfg.cluster.signal_delay_s) if os.environ.get("SLURM_JOB_ID") else None


def _vocab_size(model: torch.nn.Module) -> int | None:
    """The vocabulary the model embeds (a pretrained checkpoint's, not the config's field)."""
    get_input_embeddings = getattr(model, "get_input_embeddings", None)
    embedding = get_input_embeddings() if get_input_embeddings is not None else None
    return getattr(embedding, "num_embeddings", None)


def _trainer_state(
    cfg: JobConfig,
    dims: ParallelDims,
    engine: TrainEngine,
    done: int,
    settings: dict[str, Any],
) -> TrainerState:
    return TrainerState(
        step=done,
        samples_consumed=done * cfg.global_batch,
        world_size=dims.world_size,
        layout=repr(dims.layout),
        engine=engine.name,
        settings=settings,
    )


def _agree(
    dims: ParallelDims, save_due: bool, stop_requested: bool, writing: bool, long_step: bool
) -> tuple[bool, bool, bool, bool]:
    """Any rank's reason to save or stop is every rank's: they must act at the same step; an
    asynchronous save is complete only when no rank is still writing its part; and any rank's
    long step arms every rank's layer boundaries from the next step on."""
    flags = torch.tensor(
        [int(save_due), int(stop_requested), int(writing), int(long_step)], device=dims.device
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1]), bool(flags[2]), bool(flags[3])


def optimizer_step(
    engine: TrainEngine,
    cfg: JobConfig,
    dims: ParallelDims,
    source: Any,
    step: int,
    phases: Phases = UNTIMED,
    offload: ActivationOffload | None = None,
) -> float:
    """One optimizer step over `grad_accum` micro-batches; returns the step's global loss.

    Every rank of an SP group reads the same sequences and keeps its shard. The objective is
    the mean over every valid label of the step (all micro-batches, all ranks), plus for an MoE
    coef x the mean of its micro-batches' router load-balancing losses: each rank's loss is its
    label sum over that global count (and its share of its micro-batch's aux over the step's
    micro-batches, `RouterTokens`), times the factor that undoes the engine's gradient
    reduction (`engine.loss_scale`). `phases` times data / forward / backward / optimizer (and, on traced
    steps, marks them on the memory timeline). With `offload`, what each forward keeps for backward waits in host memory.
    """
    with phases("data"):
        samples = [
            micro_batch(source, cfg, step, m, dims.dp_rank) for m in range(cfg.train.grad_accum)
        ]
        batches = [shard_for_rank(dims, s.input_ids, s.labels, s.document_ids) for s in samples]
    losses = run_engine_step(
        engine,
        batches,
        dims.sp_size,
        dims.dp_size,
        chunk_tokens=cfg.compile.loss_chunk_tokens,
        saving=offload.saving if offload else nullcontext,
        phases=phases,
    )
    step_loss = torch.zeros((), device=dims.device)
    for micro in losses.micro_batches:
        step_loss += micro.loss.detach()
    dist.all_reduce(step_loss)
    return step_loss.item()
