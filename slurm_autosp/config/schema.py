"""The job's typed schema: one tree of dataclasses, so OmegaConf can refuse unknown keys and
wrong types by their full path; the enums of the values a key may take. Each key's docstring,
under its declaration, is its reference: config/reference.py renders docs/configuration.md's
tables from them."""

from __future__ import annotations

import dataclasses
import enum
import json
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
    none = "none"


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
    concat = "concat"
    masked = "masked"


class StopAt(str, enum.Enum):
    step = "step"
    layer = "layer"


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
    """The run's name: its directory under `output_root`, a plain directory name (no `/`, `..`
    or `%`); submitting again with the same name resumes the run."""
    output_root: str = "runs"
    """The directory runs are written under: shared storage on a cluster (`~` expanded; no
    `%`, which Slurm would expand)."""

    @property
    def dir(self) -> Path:
        return Path(self.output_root).expanduser().resolve() / self.name


@dataclass
class ClusterConfig:
    """The machines: the profile that submit-time checks and the job's resources come from."""

    backend: Backend = Backend.auto
    """`slurm`: sbatch; `local`: processes on this machine; `auto`: SLURM where `sinfo`
    answers, else local."""
    nodes: int = 1
    """Nodes the job runs on."""
    gpus_per_node: int = 0
    """GPUs a node gives the job; 0: CPU ranks with gloo (laptops, CI)."""
    tasks_per_node: int | None = None
    """Ranks a node runs; null: one rank per GPU, or 2 CPU ranks."""
    cpus_per_task: int = 1
    """CPU cores each rank is given (`#SBATCH --cpus-per-task`)."""
    vendor: Vendor = Vendor.nvidia
    """The GPUs' maker: `nvidia` (NCCL) or `amd` (RCCL); `none`: no GPUs, CPU ranks (what
    topology detects on them; `gpus_per_node=0`)."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GB: what the memory plan fits the job under."""
    host_memory_gb: float = 512.0
    """Host memory of one node in GB: activation and optimizer offload may fill 80% of it."""
    host_link_gb_per_s: float = 25.0
    """Bandwidth between one GPU and host memory in GB/s, each way, which activation and
    optimizer offload move over (PCIe 4 x16 ~25; PCIe 5 or C2C more)."""
    nvlink_domain_size: int | None = None
    """GPUs that one NVLink (or xGMI) domain joins; above `gpus_per_node`, a rack spanning
    nodes; null: all GPUs of one node."""
    fabric: Fabric = Fabric.infiniband
    """The network between nodes, which sets the collectives' environment."""
    partition: str | None = None
    """`#SBATCH --partition`; null: the site's default."""
    account: str | None = None
    """`#SBATCH --account`; null: the user's default."""
    qos: str | None = None
    """`#SBATCH --qos`; null: the site's default."""
    constraint: str | None = None
    """`#SBATCH --constraint` (node features); null: none."""
    exclusive: bool = False
    """`#SBATCH --exclusive`: the nodes are not shared with other jobs."""
    mem_gb: int | None = None
    """`#SBATCH --mem` in GB per node; null: the site's default."""
    time_min: int = 60
    """The job's time limit in minutes (`#SBATCH --time`); a preempted or timed-out job is
    requeued and resumes."""
    signal_delay_s: int = 120
    """Seconds before the time limit that SLURM sends USR2 (`#SBATCH --signal`): the time to
    stop and save."""
    stop_at: StopAt | None = None
    """Where a stop signal (USR2, SIGTERM) ends the step in flight: `step` when it ends,
    `layer` at the next decoder-layer boundary (the step in flight abandoned); null: `layer`
    for steps of a quarter of `signal_delay_s` or more, estimated by the plan or measured by
    the job from its second step on (memory_plan/stopping.py)."""
    max_requeues: int = 3
    """Times a stopped job is requeued to resume; local jobs: at most 5, submitit's local
    controller starting a job at most 6 times."""
    collective_timeout_min: float = 30.0
    """Minutes a collective waits before the job fails: above compile time plus checkpoint
    time."""
    setup: list[str] = field(default_factory=list)
    """Raw shell lines run before `srun` (`module load ...`)."""
    env: dict[str, str] = field(default_factory=dict)
    """Exported on every rank; wins over ours. `env.MASTER_PORT` fixes the rendezvous port,
    otherwise derived from the job id in 20000-32767, below Linux's ephemeral ports."""
    debug_collectives: bool = False
    """NCCL_DEBUG=INFO and friends."""
    container_image: str | None = None
    """pyxis/enroot: `srun --container-image`; null: no container."""
    container_mounts: list[str] = field(default_factory=list)
    """pyxis/enroot: `srun --container-mounts`."""
    srun_args: list[str] = field(default_factory=list)
    """Extra srun arguments. srun runs with `--kill-on-bad-exit=1`, so one failing rank ends
    the job instead of leaving the others waiting in a collective, unless these set
    `--kill-on-bad-exit`/`-K` themselves."""
    sbatch_extra: dict[str, str] = field(default_factory=dict)
    """Any other `#SBATCH` option; not those the launcher sets and a job's stops, requeues and
    logs depend on: `signal`, `time`, `requeue`, `no-requeue`, `nodes`, `ntasks`,
    `ntasks-per-node`, `gpus-per-node`, `gpus`, `open-mode`, `output`, `error`, `array`, nor
    an abbreviation sbatch reads as one of them. Each is refused naming the key to set
    instead, e.g. `cluster.signal_delay_s` for `signal`."""

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
class LoraConfig:
    """LoRA adapters (PEFT's) on the model's chosen linear layers; the base weights frozen:
    no gradients, no optimizer state, never checkpointed (every start reads them again from
    `model.pretrained_path`, or builds them from the fields and `train.seed`)."""

    rank: int = 16
    """The adapters' rank r: each adapted `in x out` linear gains r x (in + out) weights."""
    alpha: int = 32
    """The adapters' scale is alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input; above 0 only at `parallel.sp_size=1` (each rank would
    draw its own masks, and SP would not equal one device)."""
    target_modules: list[str] = field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )
    """Names (last parts) of the linear layers adapted: attention and MLP projections by
    default."""
    export_merged: bool = False
    """Besides the adapters (`adapter/`, PEFT's format), export the base with the adapters
    merged in as a Hugging Face checkpoint (`hf/`): the size of the base model."""


@dataclass
class ModelConfig:
    """A Hugging Face causal LM: fields keep HF's names and go to its config class unchanged.

    The defaults are a tiny Llama that trains on a laptop CPU. Null fields take the HF
    class's defaults. `pretrained_path` loads a local
    checkpoint instead; `builder="pkg.module:function"` calls the user's own constructor with
    this config.
    """

    model_type: str = "llama"
    """HF's model type (`llama`, `qwen3`, `mistral`, ...): which config and model class."""
    vocab_size: int | None = 256
    """HF's `vocab_size`: tokens the embedding holds; null: the HF class's default."""
    hidden_size: int | None = 64
    """HF's `hidden_size`: the width of the hidden states; null: the HF class's default."""
    intermediate_size: int | None = 128
    """HF's `intermediate_size`: the MLP's inner width; null: the HF class's default."""
    num_hidden_layers: int | None = 2
    """HF's `num_hidden_layers`: decoder layers; null: the HF class's default."""
    num_attention_heads: int | None = 4
    """HF's `num_attention_heads`: query heads, which bound the Ulysses size; null: the HF
    class's default."""
    num_key_value_heads: int | None = 2
    """HF's `num_key_value_heads`: key/value heads (GQA); null: the HF class's default."""
    head_dim: int | None = None
    """HF's `head_dim`: the width of one head; null: the HF class's default."""
    max_position_embeddings: int | None = 4096
    """HF's `max_position_embeddings`: the longest sequence the positions are set up for;
    null: the HF class's default."""
    rope_theta: float | None = None
    """HF's `rope_theta`: the rotary embedding's base; null: the HF class's default."""
    rms_norm_eps: float | None = None
    """HF's `rms_norm_eps`: the RMSNorm epsilon; null: the HF class's default."""
    tie_word_embeddings: bool | None = None
    """HF's `tie_word_embeddings`: the output layer shares the embedding's weights; null: the
    HF class's default."""
    attn_implementation: str = "sdpa"
    """HF's attention kernel: `sdpa`, the kernel AutoSP rewrites."""
    pretrained_path: str | None = None
    """A local HF checkpoint (a `save_pretrained` directory): its config and weights replace
    the fields above; null: a model of random weights from the fields."""
    builder: str | None = None
    """`"pkg.module:function"`: your own constructor, called with the model config, instead of
    HF's; null: HF builds the model."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Any other HF config field, verbatim (`model.extra.sliding_window=16`)."""
    lora: LoraConfig | None = None
    """LoRA adapters trained on the frozen model (`model.lora.rank=16`, or `model.lora={}`
    for the defaults); null: every weight is trained."""

    def hf_fields(self) -> dict[str, Any]:
        """The HF config fields that are set, with `extra` merged in."""
        skip = {"model_type", "attn_implementation", "pretrained_path", "builder", "extra", "lora"}
        fields = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in skip and getattr(self, f.name) is not None
        }
        return {**fields, **self.extra}

    def heads(self) -> tuple[int | None, int | None]:
        """(attention heads, KV heads) of the model trained: a checkpoint's own, from its
        config.json, whose architecture replaces this section's shape fields; else this
        section's. A checkpoint without a readable config.json is refused where the model is
        built (model.hf_config), so this falls back to the section's."""
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if self.pretrained_path:
            own = _checkpoint_fields(Path(self.pretrained_path).expanduser() / "config.json")
            if own.get("num_attention_heads"):
                heads, kv_heads = own["num_attention_heads"], own.get("num_key_value_heads")
        return heads, kv_heads or heads

    def heads_text(self) -> str:
        """`heads` and where they come from, as a refusal names them."""
        heads, kv_heads = self.heads()
        if self.pretrained_path:
            return (
                f"num_attention_heads={heads} / num_key_value_heads={kv_heads} of "
                f"model.pretrained_path={self.pretrained_path}"
            )
        return f"model.num_attention_heads={heads} / model.num_key_value_heads={kv_heads}"


def _checkpoint_fields(config_json: Path) -> dict[str, Any]:
    """A checkpoint's config fields; a multimodal one's text model's (`text_config`)."""
    try:
        fields = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(fields, dict):
        return {}
    text = fields.get("text_config")
    return text if "num_attention_heads" not in fields and isinstance(text, dict) else fields


@dataclass
class DataConfig:
    """Training samples: `synthetic` (deterministic and learnable) or `tokens`: a token file
    or a directory written by `python -m slurm_autosp data prepare`."""

    source: DataSource = DataSource.synthetic
    """`synthetic`: generated, deterministic and learnable samples; `tokens`: `path` or
    `blend`."""
    path: str | None = None
    """tokens: a token file or a prepared directory; null: none (synthetic, or `blend`)."""
    seq_len: int = 256
    """Tokens per sample: the sequence the SP group splits."""
    shuffle: bool = True
    """tokens: a new order of the samples each epoch, seeded by `train.seed`; false: file
    order."""
    blend: dict[str, float] = field(default_factory=dict)
    """tokens: several datasets (`{path: weight, ...}`) mixed by weight instead of `path`."""
    eval_path: str | None = None
    """Held-out data for evaluation: a prepared directory (its eval split) or a token file;
    null: `path`'s eval split when it is a prepared directory with one, else no evaluation."""
    documents: DocumentBoundaries = DocumentBoundaries.concat
    """tokens, prepared directories: `concat` joins documents by EOS and attends across them
    like one text; `masked` trains each document alone within packed samples (attention within
    each document, positions restart, no label across; by its recorded end)."""


@dataclass
class ParallelConfig:
    """How the ranks split the work: sequence parallelism and sharding."""

    sp_size: int = 1
    """Ranks one sequence is split over (the SP group) = Ulysses x ring; the rest of the
    world is data parallel."""
    ring_size: int | None = None
    """Ring attention's share of `sp_size`: Ulysses (all-to-all over heads) runs inside an
    NVLink domain, ring attention (key/value blocks passed round) across domains, which lifts
    SP past the head count; null: Ulysses as large as the heads and the NVLink domain allow,
    the ring the rest (resolved as the config is loaded: `ulysses_ring`)."""
    zero_stage: int | None = None
    """1: DeepSpeed ZeRO-1 (optimizer state sharded); 3: FSDP2 (parameters, gradients and
    optimizer state sharded; needs `compile.per_layer=true`); null: the memory plan chooses
    (1 when the job fits under it)."""
    offload_optimizer: bool | None = None
    """Optimizer state in host memory, the Adam step on the host's CPU (ZeRO-1: DeepSpeed's
    offload_optimizer; FSDP2: the fp32 shards, their gradients and Adam's moments); null: the
    memory plan decides (off where nothing needs it)."""
    allow_cross_domain: bool = False
    """Let SP groups span NVLink domains (slow; logged)."""

    @property
    def ulysses_ring(self) -> tuple[int, int]:
        """(Ulysses size, ring size) of the SP group, as `load_config` resolved them."""
        if self.ring_size is None:
            raise ConfigError(
                "parallel.ring_size is null: load_config resolves it (resolve_ring_size)"
            )
        return self.sp_size // self.ring_size, self.ring_size


class ActivationCheckpointing(str, enum.Enum):
    auto = "auto"
    sac = "sac"
    none = "none"
    full = "full"
    torch_default = "torch_default"


@dataclass
class CompileConfig:
    """The AutoSP compiler: torch.compile with the sequence-parallel pass, and what backward
    keeps or recomputes."""

    enabled: bool = False
    """Compile the model with AutoSP's pass; false: eager (needs `parallel.sp_size=1`)."""
    per_layer: bool = True
    """One graph per decoder layer: compile time flat in depth; false: one graph of the whole
    model."""
    cache_dir: str | None = None
    """The compile cache; null: node-local, under the system temp dir."""
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.auto
    """What backward keeps: `auto` (the memory plan picks the least recomputation that fits:
    sac budgets, then full), `sac` (sequence-aware: attention kept, the rest by recompute FLOPs
    per byte within the budget), `none` (everything backward needs saved), `full` (everything
    recomputed but the layer inputs, attention included), `torch_default` (torch's min-cut
    heuristics, untagged)."""
    activation_memory_budget: float | None = None
    """sac: fraction in [0, 1] of the non-attention tensors' bytes kept (dearest to recompute
    first); null: the largest the memory plan fits (1.0 on CPU ranks)."""
    recompute_all_to_all: bool = False
    """Run the Ulysses all-to-alls again in backward (saves memory); not with `auto`, where
    the plan decides."""
    loss_chunk_tokens: int = 1024
    """Tokens per cross-entropy chunk: logits never exist whole; 0: unchunked."""
    tile_tokens: int | None = None
    """Sequence tiling, tokens per tile, run tile by tile and recomputed tile by tile in
    backward: under `full` whole decoder layers (nothing outside attention spans the
    sequence), under the other policies each layer's MLP (none of its width does); 0: untiled;
    null: the plan chooses."""
    offload_activations: bool | None = None
    """What backward keeps goes to host memory during forward and comes back a layer ahead in
    backward; null: the plan decides (off where nothing needs it)."""


@dataclass
class TrainConfig:
    """The optimization: steps, batch, AdamW and its schedule, precision, evaluation."""

    steps: int = 20
    """Optimizer steps the run trains in all, across jobs."""
    micro_batch: int = 1
    """Sequences a data-parallel rank runs per forward and backward."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    lr: float = 3e-4
    """The peak learning rate, after warmup."""
    lr_schedule: LrSchedule = LrSchedule.cosine
    """The learning rate after warmup: `cosine` or `linear` decay to `min_lr_ratio` x `lr` at
    the last step, or `constant`."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to `lr`."""
    min_lr_ratio: float = 0.1
    """The learning rate at the last step, as a fraction of `lr`."""
    weight_decay: float = 0.0
    """AdamW's weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's beta1 and beta2."""
    grad_clip: float = 1.0
    """The largest global gradient norm; larger gradients are scaled down to it; 0: no
    clipping."""
    precision: Precision | None = None
    """`fp32` or `bf16`; null: bf16 on GPU, fp32 on CPU."""
    seed: int = 0
    """Seeds the weights' initialization, the synthetic data, the shuffle and the blend."""
    log_every: int = 1
    """Steps between log lines and TensorBoard scalars."""
    eval_every: int = 0
    """Held-out loss and perplexity every this many steps and after the last; 0: after the
    last only."""
    eval_samples: int = 64
    """Held-out samples per evaluation (fewer if the eval data holds fewer); 0: no
    evaluation."""
    start_check: bool = True
    """Before step 1 an SP job compares its shrunk model's AutoSP step with one device on its
    own ranks and stops if they differ (verify/start_check.py); false: no check."""


@dataclass
class CheckpointConfig:
    """When the run saves, how many saves it keeps, and how a save reaches shared storage."""

    every_steps: int | None = None
    """Steps between periodic saves; 0: none; null: the plan decides (every step where steps
    are long beside an asynchronous save's stall, so a signal loses at most the step in
    flight; else 0)."""
    every_minutes: float = 0.0
    """Minutes between periodic saves; 0: none."""
    keep: int = 2
    """Checkpoints kept (at least 1); older ones are deleted once a newer one is saved."""
    remove_damaged: bool = False
    """A checkpoint that fails verification at resume is moved aside as `damaged_step_*`,
    never deleted by a job; true: a job deletes those once it has saved a newer good
    checkpoint."""
    write_gb_per_s: float = 1.0
    """Per-rank write bandwidth to shared storage in GB/s, which sizes the signal-delay
    check."""
    async_save: bool | None = None
    """Stage each save in node memory and persist it in a background process while training
    goes on (checkpoint/async_save.py); null: on unless the plan finds no host memory to stage
    in."""
    staging_dir: str = "/dev/shm"
    """Where saves are staged: a node-local, memory-backed file system."""


@dataclass
class TraceConfig:
    """What rank 0 writes under `<run_dir>/tensorboard/`: scalars every step, memory traces
    at `memory_steps` (1-based step numbers as logged) of `memory_ranks` and the step's
    highest-peak rank."""

    tensorboard: bool = True
    """Write TensorBoard events; false: no events and no memory traces."""
    memory_steps: list[int] = field(default_factory=lambda: [2])
    """Steps whose memory is traced (step 1 is mostly compilation)."""
    memory_ranks: list[int] = field(default_factory=lambda: [0])
    """Ranks whose memory is traced."""
    memory_worst_rank: bool = True
    """Also trace the rank whose peak memory is highest."""
    memory_sample_ms: float = 5.0
    """Sampling interval of the timeline inside a traced step in ms: each sample reads and
    resets the peak, so peaks stay exact however long it is; shorter distorts the step it
    measures more."""
    memory_snapshot: bool = True
    """GPU: a PyTorch memory snapshot (memory_viz) of the traced ranks."""
    oom_snapshot: bool = True
    """GPU: a rank that runs out of memory dumps a snapshot first."""
    peak_tflops_per_gpu: float | None = None
    """One GPU's peak TFLOP/s: the MFU denominator, and the peak the signal-delay check
    estimates a step with; null: by GPU name, none on CPU."""


@dataclass
class ProbeConfig:
    """`python -m slurm_autosp probe`: how many compiled steps it measures, and the depth it
    scales the model (and the plan) down to, so a probe of a deep model stays short."""

    steps: int = 5
    """Compiled steps the probe measures: the first compiles, the rest are timed."""
    layers: int | None = None
    """The depth the probe and its plan scale the model to; null: the configured depth
    (`model.num_hidden_layers`)."""


@dataclass
class JobConfig:
    """The whole job: one section a concern, and the two keys of the submission itself."""

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
    """Print the sbatch script (or the local launch), the resolved config, the layout and the
    memory plan; submit nothing."""
    follow: bool | None = None
    """Stream rank 0's log until the job ends; null: yes for local processes, no on SLURM
    (submit returns once the job is queued, printing how to follow, check and cancel it)."""

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
