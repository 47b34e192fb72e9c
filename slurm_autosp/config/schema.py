"""The job's typed schema: one tree of dataclasses, so OmegaConf can refuse unknown keys and
wrong types by their full path; the enums of the values a key may take."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_autosp.heads import choices_text, divisors


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
    # where a stop signal (USR2, SIGTERM) ends the step in flight; null: `layer` where a step is
    # long, as the plan estimates it or as the job measures it (memory_plan/stopping.py)
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
    or a directory written by `python -m slurm_autosp data prepare`."""

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
    """`python -m slurm_autosp probe`: how many compiled steps it measures, and the depth it
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
