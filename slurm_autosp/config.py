"""The whole job as one tree of typed dataclasses.

`load_config(["cfg=configs/x.yaml", "train.steps=10"])` merges a YAML file and dotlist
overrides onto these dataclasses (OmegaConf structured configs), so unknown keys and wrong
types fail with the key's full path before anything is submitted. `validate` then checks what
types cannot: values that are out of range and fields that contradict each other.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from slurm_autosp.heads import (
    auto_ring_size,
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


def is_user_port(value: object) -> bool:
    """Whether `value` (a setting's text) names a port in USER_PORTS."""
    return str(value).isdigit() and int(str(value)) in USER_PORTS


class ConfigError(ValueError):
    """A configuration the job cannot run with; the message names the key and the fix."""


class Backend(str, enum.Enum):
    auto = "auto"
    local = "local"
    slurm = "slurm"


class Vendor(str, enum.Enum):
    nvidia = "nvidia"
    amd = "amd"
    none = "none"  # no GPUs: CPU ranks (what topology detects on them; cluster.gpus_per_node=0)


class Fabric(str, enum.Enum):
    infiniband = "infiniband"
    roce = "roce"
    efa = "efa"
    slingshot = "slingshot"
    tcp = "tcp"


class DataSource(str, enum.Enum):
    synthetic = "synthetic"
    tokens = "tokens"


class DocumentBoundaries(str, enum.Enum):
    concat = "concat"  # documents joined by EOS, attended across like one text
    masked = "masked"  # attention within each document, positions restart, no label across


class StopAt(str, enum.Enum):
    step = "step"  # a signal is acted on when the step in flight ends
    layer = "layer"  # at the next decoder-layer boundary: the step in flight is abandoned


class Precision(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class LrSchedule(str, enum.Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


@dataclass
class RunConfig:
    """Where the run lives: `<output_root>/<name>/` holds everything it writes."""

    name: str = "tiny"
    output_root: str = "runs"

    @property
    def dir(self) -> Path:
        return Path(self.output_root).expanduser().resolve() / self.name


@dataclass
class ClusterConfig:
    """The machines: the profile that submit-time checks and the job's resources come from."""

    backend: Backend = Backend.auto
    nodes: int = 1
    gpus_per_node: int = 0  # 0: CPU ranks with gloo (laptops, CI)
    tasks_per_node: int | None = None  # default: one rank per GPU, or 2 CPU ranks
    cpus_per_task: int = 1
    vendor: Vendor = Vendor.nvidia
    gpu_memory_gb: float = 80.0
    host_memory_gb: float = 512.0  # per node: what activation offload may fill (80% of it)
    host_link_gb_per_s: float = 25.0  # per GPU, each way (PCIe 4 x16 ~25; PCIe 5 or C2C more)
    nvlink_domain_size: int | None = None  # default: all GPUs of one node
    fabric: Fabric = Fabric.infiniband
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    mem_gb: int | None = None
    time_min: int = 60
    signal_delay_s: int = 120
    # where a stop signal (USR2, SIGTERM) ends the step in flight; null: the plan decides
    # (`layer` where a step is long, lifecycle/layer_stops.py)
    stop_at: StopAt | None = None
    max_requeues: int = 3
    collective_timeout_min: float = 30.0  # above compile time plus checkpoint time
    setup: list[str] = field(default_factory=list)  # shell lines before srun (module load ...)
    env: dict[str, str] = field(default_factory=dict)  # exported on every rank; wins over ours
    debug_collectives: bool = False  # NCCL_DEBUG=INFO and friends
    container_image: str | None = None  # pyxis/enroot: srun --container-image
    container_mounts: list[str] = field(default_factory=list)  # srun --container-mounts
    srun_args: list[str] = field(default_factory=list)
    sbatch_extra: dict[str, str] = field(default_factory=dict)  # any other #SBATCH option

    @property
    def ranks_per_node(self) -> int:
        return self.tasks_per_node or self.gpus_per_node or 2

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def uses_gpus(self) -> bool:
        return self.gpus_per_node > 0

    def nvlink_domain_gcd(self) -> int:
        """The ranks every NVLink domain of the profile holds a whole number of: the domain
        size (a node's ranks on CPU); with racks (domains spanning nodes), that of a rack and of
        the job's last, smaller one. A ConfigError for a profile of no whole domains."""
        if not self.uses_gpus:
            return self.ranks_per_node
        domain, gpus = self.nvlink_domain_size or self.gpus_per_node, self.gpus_per_node
        keys = f"cluster.nvlink_domain_size={domain}"
        if domain <= gpus and gpus % domain:
            raise ConfigError(
                f"{keys} does not divide cluster.gpus_per_node={gpus} (choose "
                f"{choices_text(divisors(gpus))}, or a multiple of {gpus} for racks)"
            )
        if domain > gpus and domain % gpus:
            raise ConfigError(
                f"{keys} spans nodes but is not a multiple of cluster.gpus_per_node={gpus}"
            )
        if domain <= gpus:
            return domain
        total = self.nodes * gpus  # whole racks, then the job's last, smaller one
        return math.gcd(*([domain] if total >= domain else []), total % domain)


@dataclass
class ModelConfig:
    """A Hugging Face causal LM: fields keep HF's names and go to its config class unchanged.

    The defaults are a tiny Llama that trains on a laptop CPU. Null fields take the HF
    class's defaults. `pretrained_path` loads a local
    checkpoint instead; `builder="pkg.module:function"` calls the user's own constructor with
    this config.
    """

    model_type: str = "llama"
    vocab_size: int | None = 256
    hidden_size: int | None = 64
    intermediate_size: int | None = 128
    num_hidden_layers: int | None = 2
    num_attention_heads: int | None = 4
    num_key_value_heads: int | None = 2
    head_dim: int | None = None
    max_position_embeddings: int | None = 4096
    rope_theta: float | None = None
    rms_norm_eps: float | None = None
    tie_word_embeddings: bool | None = None
    attn_implementation: str = "sdpa"
    pretrained_path: str | None = None
    builder: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other HF config fields, verbatim

    def hf_fields(self) -> dict[str, Any]:
        """The HF config fields that are set, with `extra` merged in."""
        skip = {"model_type", "attn_implementation", "pretrained_path", "builder", "extra"}
        fields = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in skip and getattr(self, f.name) is not None
        }
        return {**fields, **self.extra}


@dataclass
class DataConfig:
    """Training samples: `synthetic` (deterministic and learnable) or `tokens`: a token file
    or a directory written by `python -m slurm_autosp.data prepare`."""

    source: DataSource = DataSource.synthetic
    path: str | None = None
    seq_len: int = 256
    # tokens: a new order of the samples each epoch, seeded by train.seed (false: file order)
    shuffle: bool = True
    # tokens: several datasets (path: weight) mixed by weight instead of data.path
    blend: dict[str, float] = field(default_factory=dict)
    # held-out data for evaluation: a prepared directory (its eval split) or a token file;
    # null: data.path's eval split when it is a prepared directory with one, else no evaluation
    eval_path: str | None = None
    # tokens, prepared directories: masked trains each document alone within packed samples
    # (their recorded document ends); concat attends across document boundaries
    documents: DocumentBoundaries = DocumentBoundaries.concat


@dataclass
class ParallelConfig:
    sp_size: int = 1
    # sp_size = Ulysses x ring: Ulysses (all-to-all over heads) inside an NVLink domain, ring
    # attention (key/value blocks passed round) across domains, which lifts SP past the head
    # count; null: Ulysses as large as the heads and the NVLink domain allow, the ring the rest
    # (resolved once, as the config is loaded: `ulysses_ring`)
    ring_size: int | None = None
    # 1: DeepSpeed ZeRO-1 (optimizer state sharded); 3: FSDP2 (parameters, gradients and
    # optimizer state sharded); null: the memory plan chooses (1 when the job fits under it)
    zero_stage: int | None = None
    # optimizer state in host memory, the Adam step on the host's CPU (ZeRO-1: DeepSpeed's
    # offload_optimizer; FSDP2: the fp32 shards, their gradients and Adam's moments);
    # null: the memory plan decides (off where nothing needs it)
    offload_optimizer: bool | None = None
    allow_cross_domain: bool = False  # let SP groups span NVLink domains (slow; logged)

    @property
    def ulysses_ring(self) -> tuple[int, int]:
        """(Ulysses size, ring size) of the SP group, as `load_config` resolved them."""
        if self.ring_size is None:
            raise ConfigError(
                "parallel.ring_size is null: load_config resolves it (resolve_ring_size)"
            )
        return self.sp_size // self.ring_size, self.ring_size


class ActivationCheckpointing(str, enum.Enum):
    # the memory plan picks the least recomputation that fits (sac budgets, then full)
    auto = "auto"
    sac = "sac"  # sequence-aware: attention kept, the rest by recompute FLOPs per byte within the budget
    none = "none"  # save everything backward needs
    full = "full"  # recompute everything but the layer inputs, attention included
    torch_default = "torch_default"  # torch's min-cut heuristics, untagged


@dataclass
class CompileConfig:
    enabled: bool = False
    per_layer: bool = True  # one graph per decoder layer: compile time flat in depth
    cache_dir: str | None = None  # default: node-local, under the system temp dir
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.auto
    # sac: fraction in [0, 1] of the non-attention tensors' bytes kept (dearest to recompute
    # first); null: the largest the memory plan fits (1.0 on CPU ranks)
    activation_memory_budget: float | None = None
    # run the Ulysses all-to-alls again in backward (saves memory); under auto the plan decides
    recompute_all_to_all: bool = False
    # tokens per cross-entropy chunk: logits never exist whole; 0: unchunked
    loss_chunk_tokens: int = 1024
    # sequence tiling, tokens per tile, run tile by tile and recomputed tile by tile in backward:
    # under `full` whole decoder layers (nothing outside attention spans the sequence), under the
    # other policies each layer's MLP (none of its width does); 0: untiled; null: the plan chooses
    tile_tokens: int | None = None
    # what backward keeps goes to host memory during forward and comes back a layer ahead in
    # backward; null: the plan decides (off where nothing needs it)
    offload_activations: bool | None = None


@dataclass
class TrainConfig:
    steps: int = 20
    micro_batch: int = 1
    grad_accum: int = 1
    lr: float = 3e-4
    lr_schedule: LrSchedule = LrSchedule.cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    precision: Precision | None = None  # default: bf16 on GPU, fp32 on CPU
    seed: int = 0
    log_every: int = 1
    # held-out loss and perplexity every this many steps and after the last; 0: after the last only
    eval_every: int = 0
    # held-out samples per evaluation (fewer if the eval data holds fewer); 0: no evaluation
    eval_samples: int = 64
    # before step 1 an SP job compares its shrunk model's AutoSP step with one device on its own
    # ranks and stops if they differ (verify/start_check.py); false: no check
    start_check: bool = True


@dataclass
class CheckpointConfig:
    # 0: no periodic saves; null: the plan decides (every step where steps are long beside an
    # asynchronous save's stall, so a signal loses at most the step in flight; else 0)
    every_steps: int | None = None
    every_minutes: float = 0.0
    keep: int = 2
    # a checkpoint that fails verification at resume is moved aside as damaged_step_*, never
    # deleted by a job; true: a job deletes those once it has saved a newer good checkpoint
    remove_damaged: bool = False
    # per-rank write bandwidth to shared storage, to size the signal delay
    write_gb_per_s: float = 1.0
    # stage each save in node memory and persist it in a background process while training goes
    # on (checkpoint/async_save.py); null: on unless the plan finds no host memory to stage in
    async_save: bool | None = None
    # where saves are staged: a node-local, memory-backed file system
    staging_dir: str = "/dev/shm"


@dataclass
class TraceConfig:
    """What rank 0 writes under `<run_dir>/tensorboard/`: scalars every step, memory traces
    at `memory_steps` (1-based step numbers as logged) of `memory_ranks` and the step's
    highest-peak rank."""

    tensorboard: bool = True  # false: no events and no memory traces
    memory_steps: list[int] = field(default_factory=lambda: [2])  # step 1 is mostly compilation
    memory_ranks: list[int] = field(default_factory=lambda: [0])
    memory_worst_rank: bool = True  # also trace the rank whose peak memory is highest
    # sampling interval of the timeline inside a traced step: each sample reads and resets the
    # peak, so peaks stay exact however long it is; shorter distorts the step it measures more
    memory_sample_ms: float = 5.0
    memory_snapshot: bool = True  # GPU: PyTorch memory snapshot (memory_viz) of the traced ranks
    oom_snapshot: bool = True  # GPU: a rank that runs out of memory dumps a snapshot first
    peak_tflops_per_gpu: float | None = None  # MFU denominator; default by GPU name, none on CPU


@dataclass
class ProbeConfig:
    """`python -m slurm_autosp.probe`: how many compiled steps it measures, and the depth it
    scales the model (and the plan) down to, so a probe of a deep model stays short."""

    steps: int = 5  # the first compiles; the rest are timed
    layers: int | None = None  # null: the configured depth (model.num_hidden_layers)


@dataclass
class JobConfig:
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    dry_run: bool = False
    # stream rank 0's log until the job ends; null: yes for local processes, no on SLURM
    # (submit returns once the job is queued, printing how to follow, check and cancel it)
    follow: bool | None = None

    @property
    def precision(self) -> Precision:
        if self.train.precision is not None:
            return self.train.precision
        return Precision.bf16 if self.cluster.uses_gpus else Precision.fp32

    @property
    def dp_size(self) -> int:
        return self.cluster.world_size // self.parallel.sp_size

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step, across all data-parallel ranks and micro-steps."""
        return self.train.micro_batch * self.train.grad_accum * self.dp_size


def load_config(argv: list[str]) -> JobConfig:
    """Merge `cfg=PATH.yaml` and `a.b=c` overrides onto the defaults, then validate."""
    cfg_path = None
    overrides = []
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(
                f"argument {arg!r} is not key=value; use cfg=PATH.yaml and overrides like "
                "train.steps=100"
            )
        key, value = arg.split("=", 1)
        if key == "cfg":
            cfg_path = value
        else:
            overrides.append(arg)

    merged: DictConfig = OmegaConf.structured(JobConfig)
    if cfg_path is not None:
        merged = _merge(merged, _read_yaml(cfg_path), f"in {cfg_path}")
    merged = _merge(merged, _parse_overrides(overrides), "on the command line")
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, JobConfig)
    validate(cfg)
    if cfg.parallel.ring_size is None:
        cfg.parallel.ring_size = resolve_ring_size(cfg)
    return cfg


def resolve_ring_size(cfg: JobConfig) -> int:
    """The ring size a null `parallel.ring_size` stands for: the Ulysses size as large as the
    heads the config names and the profile's NVLink domains allow, the ring the rest
    (heads.auto_ring_size). A checkpoint's own heads meet it at admission."""
    p, m = cfg.parallel, cfg.model
    return auto_ring_size(
        p.sp_size,
        cfg.cluster.nvlink_domain_gcd(),
        m.num_attention_heads,
        m.num_key_value_heads or m.num_attention_heads,
        p.allow_cross_domain,
    )


def to_yaml(cfg: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _read_yaml(path: str) -> DictConfig:
    if not os.path.isfile(path):
        raise ConfigError(
            f"cfg={path}: no such file (give the path of a YAML config, e.g. configs/tiny_cpu.yaml)"
        )
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:  # yaml.YAMLError and friends
        raise ConfigError(f"cfg={path}: not valid YAML: {err}") from err
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"cfg={path}: expected a mapping of sections (run:, model:, train:, ...)")
    return loaded


def _parse_overrides(overrides: list[str]) -> DictConfig:
    """The overrides as one config; each value is read as YAML, so one YAML cannot read is named,
    and so is one YAML would cut at ' #' (a comment: run.name=exp #1 would read as exp)."""
    for override in overrides:
        key, _, value = override.partition("=")
        try:
            read = OmegaConf.from_dotlist([override])
        except Exception as err:  # OmegaConf's own errors and yaml's scanner/parser errors alike
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            hint = "; quote it" if isinstance(err, yaml.YAMLError) else ""
            raise ConfigError(
                f"{key} on the command line: cannot read the value {value!r} ({reason}){hint}, "
                f"e.g. {key}='\"{value}\"' in the shell"
            ) from err
        if "#" in value and "#" not in str(OmegaConf.to_container(read)):
            raise ConfigError(
                f"{key} on the command line: the value {value!r} would read as "
                f"{OmegaConf.select(read, key)!r} (YAML takes ' #' and what follows for a "
                f"comment); quote it, e.g. {key}='\"{value}\"' in the shell"
            )
    return OmegaConf.from_dotlist(overrides)


def _merge(base: DictConfig, update: DictConfig, where: str) -> DictConfig:
    try:
        merged = OmegaConf.merge(base, update)
    except OmegaConfBaseException as err:
        raise ConfigError(_explain(err, where)) from err
    assert isinstance(merged, DictConfig)  # two DictConfigs merge into one
    return merged


def _explain(err: OmegaConfBaseException, where: str) -> str:
    """One line naming the full key, OmegaConf's reason, and the keys that section accepts."""
    key = getattr(err, "full_key", None) or "?"
    reason = str(err).splitlines()[0]
    section = getattr(err, "object_type", None)
    if isinstance(err, ConfigKeyError) and dataclasses.is_dataclass(section):
        known = ", ".join(f.name for f in dataclasses.fields(section))
        return f"{key} {where}: unknown key. {reason} Known keys here: {known}"
    return f"{key} {where}: {reason}"


def validate(cfg: JobConfig) -> None:
    """Checks that types cannot express; each message names the key and what would work."""
    problems = list(_non_finite(cfg, ""))
    c, t, p, m = cfg.cluster, cfg.train, cfg.parallel, cfg.model

    def positive(key: str, value: float) -> None:
        if value <= 0:
            problems.append(f"{key}={value} must be > 0")

    for key, value in [
        ("cluster.nodes", c.nodes),
        ("cluster.cpus_per_task", c.cpus_per_task),
        ("cluster.time_min", c.time_min),
        ("cluster.host_memory_gb", c.host_memory_gb),
        ("cluster.host_link_gb_per_s", c.host_link_gb_per_s),
        ("data.seq_len", cfg.data.seq_len),
        ("parallel.sp_size", p.sp_size),
        ("train.steps", t.steps),
        ("train.micro_batch", t.micro_batch),
        ("train.grad_accum", t.grad_accum),
        ("train.lr", t.lr),
        ("train.log_every", t.log_every),
    ]:
        positive(key, value)
    if t.eval_every < 0:
        problems.append(
            f"train.eval_every={t.eval_every} must be >= 0 (0: after the last step only)"
        )
    if t.eval_samples < 0:
        problems.append(f"train.eval_samples={t.eval_samples} must be >= 0 (0: no evaluation)")
    for key, count in [("probe.steps", cfg.probe.steps), ("probe.layers", cfg.probe.layers)]:
        if count is not None and count < 1:
            problems.append(f"{key}={count} must be >= 1")
    if cfg.data.seq_len == 1:
        problems.append(
            "data.seq_len=1 leaves no label to predict (each token predicts the next); use >= 2"
        )
    for key, value in [
        ("checkpoint.keep", cfg.checkpoint.keep),
        ("cluster.signal_delay_s", c.signal_delay_s),
    ]:
        if value < 1:
            problems.append(
                f"{key}={value} must be >= 1"
                + (
                    " (keep=0 would delete every checkpoint, the one just written included)"
                    if key == "checkpoint.keep"
                    else ""
                )
            )
    if not Path(cfg.checkpoint.staging_dir).is_absolute():
        problems.append(
            f"checkpoint.staging_dir={cfg.checkpoint.staging_dir!r} must be an absolute path on "
            "each node (a memory-backed file system such as /dev/shm)"
        )
    if c.signal_delay_s > MAX_SIGNAL_DELAY_S:
        problems.append(
            f"cluster.signal_delay_s={c.signal_delay_s} is more than SLURM's pre-timeout signal "
            f"can be sent ahead ({MAX_SIGNAL_DELAY_S} s: sbatch keeps it in 16 bits); give "
            f"at most {MAX_SIGNAL_DELAY_S}"
        )
    for key, value in [
        ("checkpoint.write_gb_per_s", cfg.checkpoint.write_gb_per_s),
        ("cluster.collective_timeout_min", c.collective_timeout_min),
    ]:
        positive(key, value)
    for key, value in [("cluster.max_requeues", c.max_requeues), ("cluster.mem_gb", c.mem_gb or 0)]:
        if value < 0:
            problems.append(f"{key}={value} must be >= 0")
    problems.extend(_script_value_problems(cfg))
    if c.gpus_per_node < 0:
        problems.append(f"cluster.gpus_per_node={c.gpus_per_node} must be >= 0 (0 runs on CPU)")
    if c.vendor is Vendor.none and c.gpus_per_node > 0:
        problems.append(
            f"cluster.vendor=none with cluster.gpus_per_node={c.gpus_per_node}: "
            "choose nvidia or amd (none is for CPU ranks)"
        )
    if c.tasks_per_node is not None:
        positive("cluster.tasks_per_node", c.tasks_per_node)
        if c.uses_gpus and c.tasks_per_node != c.gpus_per_node:
            problems.append(
                f"cluster.tasks_per_node={c.tasks_per_node} must equal cluster.gpus_per_node="
                f"{c.gpus_per_node} (one rank per GPU); leave tasks_per_node unset"
            )
    if p.sp_size > 0 and c.world_size % p.sp_size:
        problems.append(
            f"parallel.sp_size={p.sp_size} does not divide the world size "
            f"{c.world_size} (cluster.nodes={c.nodes} x {c.ranks_per_node} ranks per node); "
            f"choose one of {choices_text(divisors(c.world_size))}"
        )
    if p.zero_stage not in ZERO_STAGES:
        problems.append(
            f"parallel.zero_stage={p.zero_stage} is not supported; use 1 (DeepSpeed ZeRO-1), "
            "3 (FSDP2 parameter sharding) or null (the memory plan chooses)"
        )
    if p.sp_size > 1 and not cfg.compile.enabled:
        problems.append(
            f"parallel.sp_size={p.sp_size} needs the AutoSP compiler: set compile.enabled=true"
        )
    problems.extend(_compile_problems(cfg))
    problems.extend(_ring_problems(cfg))
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
    if c.nvlink_domain_size is not None and c.nvlink_domain_size < 1:
        problems.append(f"cluster.nvlink_domain_size={c.nvlink_domain_size} must be >= 1")
    if c.backend is Backend.local and c.nodes != 1:
        problems.append(
            f"cluster.nodes={c.nodes}: the local backend runs on one machine; set cluster.nodes=1"
        )
    if cfg.precision is Precision.bf16 and not c.uses_gpus:
        problems.append(
            "train.precision=bf16 needs GPUs (cluster.gpus_per_node > 0); use fp32 on CPU"
        )
    for path, weight in cfg.data.blend.items():
        if not os.path.exists(path):
            problems.append(f"data.blend: {path}: no such file or directory")
        if weight <= 0:
            problems.append(f"data.blend: {path}: weight {weight} must be > 0")
    if cfg.data.blend and cfg.data.path:
        problems.append("data.blend and data.path are exclusive; set one")
    if cfg.data.eval_path and not os.path.exists(cfg.data.eval_path):
        problems.append(f"data.eval_path={cfg.data.eval_path}: no such file or directory")
    if cfg.data.source is DataSource.tokens and not cfg.data.blend:
        if not cfg.data.path:
            problems.append(
                "data.source=tokens needs data.path (a token file, or a directory written by "
                "python -m slurm_autosp.data prepare)"
            )
        elif not os.path.exists(cfg.data.path):
            problems.append(f"data.path={cfg.data.path}: no such file or directory")
    if cfg.data.documents is DocumentBoundaries.masked:
        if cfg.data.source is not DataSource.tokens:
            problems.append(
                "data.documents=masked needs data.source=tokens (a prepared directory records "
                "where its documents end; synthetic samples have no documents)"
            )
        if not cfg.compile.enabled or cfg.model.builder:
            problems.append(
                "data.documents=masked needs compile.enabled=true and a Hugging Face model (not "
                "model.builder): attention within each document is AutoSP's attention function"
            )
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
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


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


def _ring_problems(cfg: JobConfig) -> list[str]:
    """The Ulysses x ring split of `parallel.sp_size`: the ring divides it and the heads split
    over the Ulysses size (null is resolved with the topology: cluster.placement)."""
    p, m = cfg.parallel, cfg.model
    if p.sp_size < 1 or p.ring_size is None:
        return []
    heads, kv_heads = m.num_attention_heads, m.num_key_value_heads or m.num_attention_heads
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
            f"{ulysses} cannot split model.num_attention_heads={heads} / "
            f"model.num_key_value_heads={kv_heads} over its ranks (Ulysses sizes the heads allow: "
            f"{choices_text(valid_sp_sizes(heads, kv_heads))}); {works}"
        ]
    return []


def _compile_problems(cfg: JobConfig) -> list[str]:
    """Checkpointing and compile settings that contradict each other or the ZeRO stage."""
    problems = []
    c = cfg.compile
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
    if cfg.cluster.stop_at is StopAt.layer and c.enabled and not c.per_layer:
        problems.append(
            "cluster.stop_at=layer with compile.per_layer=false: a stop between layers needs each "
            "layer compiled on its own; set compile.per_layer=true, or cluster.stop_at=step"
        )
    if cfg.parallel.zero_stage == 3 and c.enabled and not c.per_layer:
        problems.append(
            "parallel.zero_stage=3 with compile.per_layer=false: parameter sharding compiles one graph "
            "per decoder layer; set compile.per_layer=true"
        )
    return problems
