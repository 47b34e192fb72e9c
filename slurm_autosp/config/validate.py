"""What types cannot check: values out of range and fields that contradict each other. One
function a section, then the checks over the whole tree and those across sections, so a new
check goes next to the key it reads and every problem is reported at once."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from pathlib import Path

from slurm_autosp.config.schema import (
    ActivationCheckpointing,
    Backend,
    CheckpointConfig,
    ClusterConfig,
    CompileConfig,
    ConfigError,
    DataConfig,
    DataSource,
    DocumentBoundaries,
    JobConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    Precision,
    ProbeConfig,
    StopAt,
    TrainConfig,
    Vendor,
)
from slurm_autosp.heads import (
    choices_text,
    divisors,
    pairs_text,
    ulysses_ring_pairs,
    valid_sp_sizes,
)

ZERO_STAGES = (None, 1, 3)  # null: the memory plan chooses
USER_PORTS = range(1024, 65536)  # what MASTER_PORT may be: no privileged port
# sbatch --signal=USR2@<seconds>: Slurm keeps the time in 16 bits (job_desc_msg_t.warn_time)
MAX_SIGNAL_DELAY_S = 65535
# The #SBATCH options the launcher sets (launch/executor.py, submitit) that a job's stops,
# requeues and logs depend on: cluster.sbatch_extra would replace them. Each with why, and
# what to do instead.
LAUNCHER_SBATCH_OPTIONS: dict[str, tuple[str, str]] = {
    "signal": (
        "every rank stops and saves on USR2, sent ahead of the time limit by the delay that "
        "admission holds to a stop plus a save",
        "set cluster.signal_delay_s instead",
    ),
    "time": ("the stop signal is sent ahead of this limit", "set cluster.time_min instead"),
    "requeue": (
        "rank 0 requeues the job after its stop save",
        "set cluster.max_requeues instead (0: never requeued)",
    ),
    "no-requeue": (
        "rank 0 requeues the job after its stop save",
        "set cluster.max_requeues=0 instead",
    ),
    "nodes": (
        "each rank checks the job's task count against the config",
        "set cluster.nodes instead",
    ),
    "ntasks": (
        "each rank checks the job's task count against the config",
        "set cluster.nodes and cluster.gpus_per_node instead",
    ),
    "ntasks-per-node": (
        "each rank checks the job's task count against the config",
        "set cluster.gpus_per_node (cluster.tasks_per_node for CPU ranks) instead",
    ),
    "gpus-per-node": (
        "the layout and the plan are made for it",
        "set cluster.gpus_per_node instead",
    ),
    "gpus": (
        "the layout and the plan are made for the GPUs of each node",
        "set cluster.nodes and cluster.gpus_per_node instead",
    ),
    "open-mode": (
        "a requeued start appends to the logs that status and --follow read",
        "let every start append",
    ),
    "output": (
        "status and --follow read the job's logs where submitit puts them",
        "choose the run directory they go under with run.output_root and run.name",
    ),
    "error": (
        "status and --follow read the job's logs where submitit puts them",
        "choose the run directory they go under with run.output_root and run.name",
    ),
    "array": ("one job trains a run, requeued under one job id", "submit one job per run"),
}


def is_user_port(value: object) -> bool:
    """Whether `value` (a setting's text) names a port in USER_PORTS."""
    return str(value).isdigit() and int(str(value)) in USER_PORTS


def validate(cfg: JobConfig) -> None:
    """Checks that types cannot express; each message names the key and what would work."""
    problems = [
        *_non_finite(cfg, ""),
        *_cluster_problems(cfg.cluster),
        *_model_problems(cfg.model),
        *_data_problems(cfg.data),
        *_parallel_problems(cfg.parallel),
        *_compile_problems(cfg.compile),
        *_train_problems(cfg.train),
        *_checkpoint_problems(cfg.checkpoint),
        *_probe_problems(cfg.probe),
        *_script_value_problems(cfg),
        *_cross_section_problems(cfg),
    ]
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def _not_positive(*keyed: tuple[str, float]) -> list[str]:
    return [f"{key}={value} must be > 0" for key, value in keyed if value <= 0]


def _cluster_problems(c: ClusterConfig) -> list[str]:
    problems = _not_positive(
        ("cluster.nodes", c.nodes),
        ("cluster.cpus_per_task", c.cpus_per_task),
        ("cluster.time_min", c.time_min),
        ("cluster.host_memory_gb", c.host_memory_gb),
        ("cluster.host_link_gb_per_s", c.host_link_gb_per_s),
    )
    if c.signal_delay_s < 1:
        problems.append(f"cluster.signal_delay_s={c.signal_delay_s} must be >= 1")
    if c.signal_delay_s > MAX_SIGNAL_DELAY_S:
        problems.append(
            f"cluster.signal_delay_s={c.signal_delay_s} is more than SLURM's pre-timeout signal "
            f"can be sent ahead ({MAX_SIGNAL_DELAY_S} s: sbatch keeps it in 16 bits); give "
            f"at most {MAX_SIGNAL_DELAY_S}"
        )
    problems += _not_positive(("cluster.collective_timeout_min", c.collective_timeout_min))
    for key, value in [("cluster.max_requeues", c.max_requeues), ("cluster.mem_gb", c.mem_gb or 0)]:
        if value < 0:
            problems.append(f"{key}={value} must be >= 0")
    if c.gpus_per_node < 0:
        problems.append(f"cluster.gpus_per_node={c.gpus_per_node} must be >= 0 (0 runs on CPU)")
    if c.vendor is Vendor.none and c.gpus_per_node > 0:
        problems.append(
            f"cluster.vendor=none with cluster.gpus_per_node={c.gpus_per_node}: "
            "choose nvidia or amd (none is for CPU ranks)"
        )
    if c.tasks_per_node is not None:
        problems += _not_positive(("cluster.tasks_per_node", c.tasks_per_node))
        if c.uses_gpus and c.tasks_per_node != c.gpus_per_node:
            problems.append(
                f"cluster.tasks_per_node={c.tasks_per_node} must equal cluster.gpus_per_node="
                f"{c.gpus_per_node} (one rank per GPU); leave tasks_per_node unset"
            )
    if c.nvlink_domain_size is not None and c.nvlink_domain_size < 1:
        problems.append(f"cluster.nvlink_domain_size={c.nvlink_domain_size} must be >= 1")
    if c.backend is Backend.local and c.nodes != 1:
        problems.append(
            f"cluster.nodes={c.nodes}: the local backend runs on one machine; set cluster.nodes=1"
        )
    return problems + [
        _replaced_option_problem(key, name)
        for key in c.sbatch_extra
        if (name := _launcher_option(key)) is not None
    ]


def _launcher_option(key: str) -> str | None:
    """The launcher's option (LAUNCHER_SBATCH_OPTIONS) that a cluster.sbatch_extra key would
    replace: rendered `#SBATCH --<key, _ as ->`, which sbatch also reads as any option it
    abbreviates unambiguously (`--sig` is `--signal`)."""
    flag = key.replace("_", "-")
    return next((name for name in LAUNCHER_SBATCH_OPTIONS if flag and name.startswith(flag)), None)


def _replaced_option_problem(key: str, name: str) -> str:
    why, fix = LAUNCHER_SBATCH_OPTIONS[name]
    return (
        f"cluster.sbatch_extra.{key}: the launcher sets #SBATCH --{name} itself and the job "
        f"depends on it ({why}); remove it and {fix}"
    )


def _model_problems(m: ModelConfig) -> list[str]:
    problems = []
    if m.pretrained_path and m.builder:
        problems.append("model.pretrained_path and model.builder are exclusive; set one")
    if m.pretrained_path and not os.path.isdir(m.pretrained_path):
        problems.append(f"model.pretrained_path={m.pretrained_path}: no such directory")
    if m.builder and ":" not in m.builder:
        problems.append(f"model.builder={m.builder!r} must look like 'package.module:function'")
    if not (m.pretrained_path or m.builder):
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if getattr(m, key) is None:
                problems.append(f"model.{key} is required to build a model from its config")
    if m.lora is not None:
        problems.extend(_lora_problems(m.lora))
    return problems


def _lora_problems(lora: LoraConfig) -> list[str]:
    problems = _not_positive(("model.lora.rank", lora.rank), ("model.lora.alpha", lora.alpha))
    if not 0 <= lora.dropout < 1:
        problems.append(f"model.lora.dropout={lora.dropout} must be in [0, 1)")
    if not lora.target_modules:
        problems.append(
            "model.lora.target_modules is empty: name the linear layers to adapt (e.g. [q_proj, v_proj])"
        )
    bad = [
        name
        for name in lora.target_modules
        if not name or not name.replace("_", "").replace(".", "").isalnum()
    ]
    if bad:
        problems.append(
            f"model.lora.target_modules: {bad!r} are not module names (letters, digits, _ and .)"
        )
    return problems


def _data_problems(d: DataConfig) -> list[str]:
    problems = _not_positive(("data.seq_len", d.seq_len))
    if d.seq_len == 1:
        problems.append(
            "data.seq_len=1 leaves no label to predict (each token predicts the next); use >= 2"
        )
    for path, weight in d.blend.items():
        if not os.path.exists(path):
            problems.append(f"data.blend: {path}: no such file or directory")
        if weight <= 0:
            problems.append(f"data.blend: {path}: weight {weight} must be > 0")
    if d.blend and d.path:
        problems.append("data.blend and data.path are exclusive; set one")
    if d.eval_path and not os.path.exists(d.eval_path):
        problems.append(f"data.eval_path={d.eval_path}: no such file or directory")
    if d.source is DataSource.tokens and not d.blend:
        if not d.path:
            problems.append(
                "data.source=tokens needs data.path (a token file, or a directory written by "
                "python -m slurm_autosp data prepare)"
            )
        elif not os.path.exists(d.path):
            problems.append(f"data.path={d.path}: no such file or directory")
    if d.documents is DocumentBoundaries.masked and d.source is not DataSource.tokens:
        problems.append(
            "data.documents=masked needs data.source=tokens (a prepared directory records "
            "where its documents end; synthetic samples have no documents)"
        )
    return problems


def _parallel_problems(p: ParallelConfig) -> list[str]:
    problems = _not_positive(("parallel.sp_size", p.sp_size))
    if p.zero_stage not in ZERO_STAGES:
        problems.append(
            f"parallel.zero_stage={p.zero_stage} is not supported; use 1 (DeepSpeed ZeRO-1), "
            "3 (FSDP2 parameter sharding) or null (the memory plan chooses)"
        )
    return problems


def _compile_problems(c: CompileConfig) -> list[str]:
    problems = []
    if c.activation_memory_budget is not None and not 0.0 <= c.activation_memory_budget <= 1.0:
        problems.append(
            f"compile.activation_memory_budget={c.activation_memory_budget} must be in [0, 1] "
            "(or null: from the memory plan)"
        )
    if c.activation_checkpointing is ActivationCheckpointing.auto:
        if c.activation_memory_budget is not None:
            problems.append(
                f"compile.activation_memory_budget={c.activation_memory_budget} applies to sac only; "
                "compile.activation_checkpointing=auto chooses the budget itself: set "
                "compile.activation_checkpointing=sac or leave the budget null"
            )
        if c.recompute_all_to_all:
            problems.append(
                "compile.recompute_all_to_all=true: compile.activation_checkpointing=auto decides "
                "that itself; to force it set compile.activation_checkpointing=sac or full"
            )
    if c.tile_tokens is not None and c.tile_tokens < 0:
        problems.append(
            f"compile.tile_tokens={c.tile_tokens} must be >= 0 (0: untiled; null: the plan chooses)"
        )
    if c.loss_chunk_tokens < 0:
        problems.append(
            f"compile.loss_chunk_tokens={c.loss_chunk_tokens} must be >= 0 (0: unchunked)"
        )
    return problems


def _train_problems(t: TrainConfig) -> list[str]:
    problems = _not_positive(
        ("train.steps", t.steps),
        ("train.micro_batch", t.micro_batch),
        ("train.grad_accum", t.grad_accum),
        ("train.lr", t.lr),
        ("train.log_every", t.log_every),
    )
    if t.eval_every < 0:
        problems.append(
            f"train.eval_every={t.eval_every} must be >= 0 (0: after the last step only)"
        )
    if t.eval_samples < 0:
        problems.append(f"train.eval_samples={t.eval_samples} must be >= 0 (0: no evaluation)")
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        problems.append(
            f"train.betas={list(t.betas)} must be two numbers in [0, 1), e.g. [0.9, 0.95]"
        )
    if not 0 <= t.min_lr_ratio <= 1:
        problems.append(f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    if t.warmup_steps < 0:
        problems.append(f"train.warmup_steps={t.warmup_steps} must be >= 0")
    if t.grad_clip < 0:
        problems.append(f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
    return problems


def _checkpoint_problems(c: CheckpointConfig) -> list[str]:
    problems = []
    if c.keep < 1:
        problems.append(
            f"checkpoint.keep={c.keep} must be >= 1 (keep=0 would delete every checkpoint, the "
            "one just written included)"
        )
    if not Path(c.staging_dir).is_absolute():
        problems.append(
            f"checkpoint.staging_dir={c.staging_dir!r} must be an absolute path on "
            "each node (a memory-backed file system such as /dev/shm)"
        )
    return problems + _not_positive(("checkpoint.write_gb_per_s", c.write_gb_per_s))


def _probe_problems(p: ProbeConfig) -> list[str]:
    return [
        f"{key}={count} must be >= 1"
        for key, count in [("probe.steps", p.steps), ("probe.layers", p.layers)]
        if count is not None and count < 1
    ]


def _non_finite(value: object, key: str) -> Iterator[str]:
    """Every float under `value` that is NaN or infinite, by its full key: no range check
    catches NaN (every comparison with it is false), and YAML reads nan, .inf and 1e999."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _non_finite(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _non_finite(item, f"{key}.{name}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _non_finite(item, f"{key}[{index}]")
    elif isinstance(value, float) and not math.isfinite(value):
        yield f"{key}={value} is not a finite number; give a finite value"


def _script_value_problems(cfg: JobConfig) -> list[str]:
    """Values rendered into the sbatch script or used as a path: a newline would end the
    #SBATCH block (the directives after it silently dropped, the rest run as shell), a run
    name with a path separator or `..` escapes run.output_root, and a `%` in the run directory
    is expanded by Slurm in the log paths. Spaces, `#` and quotes are safe: submitit quotes
    every #SBATCH value and srun argument, and sbatch reads quotes in #SBATCH lines."""
    c = cfg.cluster
    rendered: list[tuple[str, object]] = [
        ("run.name", cfg.run.name),
        ("run.output_root", cfg.run.output_root),
        ("checkpoint.staging_dir", cfg.checkpoint.staging_dir),
        ("cluster.partition", c.partition),
        ("cluster.account", c.account),
        ("cluster.qos", c.qos),
        ("cluster.constraint", c.constraint),
        ("cluster.container_image", c.container_image),
        *((f"cluster.sbatch_extra.{k}", f"{k}={v}") for k, v in c.sbatch_extra.items()),
        *((f"cluster.srun_args[{i}]", v) for i, v in enumerate(c.srun_args)),
        *((f"cluster.container_mounts[{i}]", v) for i, v in enumerate(c.container_mounts)),
        *((f"cluster.env.{k}", f"{k}={v}") for k, v in c.env.items()),
    ]
    problems = [
        f"{key}={value!r} contains a control character (newline, tab, ...); it would break the job script"
        for key, value in rendered
        if value is not None and any(ch < " " or ch == "\x7f" for ch in str(value))
    ]
    bad_env = [k for k in c.env if not k or "=" in k]
    if bad_env:
        problems.append(
            f"cluster.env keys {bad_env} are not variable names (empty, or containing '=')"
        )
    port = c.env.get("MASTER_PORT")
    if port is not None and not is_user_port(port):
        problems.append(
            f"cluster.env.MASTER_PORT={port!r} must be a port number in 1024-65535 "
            "(the job's rendezvous port on its first host); unset it to derive one from the job id"
        )
    name = cfg.run.name
    if name in ("", ".", "..") or any(ch in name for ch in "/\\%") or name.startswith("-"):
        problems.append(
            f"run.name={name!r} must be a plain directory name (no '/', '\\', '%', not '.', '..', empty or "
            "starting with '-'): it names <run.output_root>/<run.name> and the job's log files"
        )
    root = str(Path(cfg.run.output_root).expanduser().resolve())
    if "%" in root:
        problems.append(
            f"run.output_root={cfg.run.output_root!r} puts '%' in the run directory ({root}): Slurm "
            "expands % patterns (%j, %u, ...) in the job's log paths (#SBATCH --output) while "
            "submitit reads them literally, so the logs would be lost; choose a directory without '%'"
        )
    return problems


def _cross_section_problems(cfg: JobConfig) -> list[str]:
    """Keys of one section that contradict another's: the SP group against the world, the
    compiler and the model's heads; stops and sharding against per-layer compilation; bf16
    against CPU ranks; masked documents against the model."""
    c, p = cfg.cluster, cfg.parallel
    problems = []
    if p.sp_size > 0 and c.world_size % p.sp_size:
        problems.append(
            f"parallel.sp_size={p.sp_size} does not divide the world size "
            f"{c.world_size} (cluster.nodes={c.nodes} x {c.ranks_per_node} ranks per node); "
            f"choose one of {choices_text(divisors(c.world_size))}"
        )
    if p.sp_size > 1 and not cfg.compile.enabled:
        problems.append(
            f"parallel.sp_size={p.sp_size} needs the AutoSP compiler: set compile.enabled=true"
        )
    one_graph = cfg.compile.enabled and not cfg.compile.per_layer
    if c.stop_at is StopAt.layer and one_graph:
        problems.append(
            "cluster.stop_at=layer with compile.per_layer=false: a stop between layers needs each "
            "layer compiled on its own; set compile.per_layer=true, or cluster.stop_at=step"
        )
    if p.zero_stage == 3 and one_graph:
        problems.append(
            "parallel.zero_stage=3 with compile.per_layer=false: parameter sharding compiles one graph "
            "per decoder layer; set compile.per_layer=true"
        )
    problems.extend(_ring_problems(cfg))
    if cfg.precision is Precision.bf16 and not c.uses_gpus:
        problems.append(
            "train.precision=bf16 needs GPUs (cluster.gpus_per_node > 0); use fp32 on CPU"
        )
    lora = cfg.model.lora
    if lora is not None and lora.dropout > 0 and p.sp_size > 1:
        problems.append(
            f"model.lora.dropout={lora.dropout} with parallel.sp_size={p.sp_size}: each rank would "
            "draw its own dropout masks for its part of the sequence, and training would not equal "
            "one device's; set model.lora.dropout=0"
        )
    masked = cfg.data.documents is DocumentBoundaries.masked
    if masked and (not cfg.compile.enabled or cfg.model.builder):
        problems.append(
            "data.documents=masked needs compile.enabled=true and a Hugging Face model (not "
            "model.builder): attention within each document is AutoSP's attention function"
        )
    return problems


def _ring_problems(cfg: JobConfig) -> list[str]:
    """The Ulysses x ring split of `parallel.sp_size`: the ring divides it and the heads split
    over the Ulysses size (a null ring size is resolved after these checks: resolve_ring_size)."""
    p, m = cfg.parallel, cfg.model
    if p.sp_size < 1 or p.ring_size is None:
        return []
    heads, kv_heads = m.heads()
    pairs = ulysses_ring_pairs(p.sp_size, heads, kv_heads)
    works = (
        f"(Ulysses x ring) splits of parallel.sp_size={p.sp_size} that work: {pairs_text(pairs)}"
    )
    if p.ring_size < 1 or p.sp_size % p.ring_size:
        return [
            f"parallel.ring_size={p.ring_size} does not divide parallel.sp_size={p.sp_size} "
            f"(sp_size = Ulysses x ring); {works}, or null to choose"
        ]
    ulysses = p.sp_size // p.ring_size
    if heads and kv_heads and ulysses not in valid_sp_sizes(heads, kv_heads):
        return [
            f"parallel.sp_size={p.sp_size} / parallel.ring_size={p.ring_size}: the Ulysses size "
            f"{ulysses} cannot split {m.heads_text()} over its ranks (Ulysses sizes the heads allow: "
            f"{choices_text(valid_sp_sizes(heads, kv_heads))}); {works}"
        ]
    return []
