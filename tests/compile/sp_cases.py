"""What every rank runs in the equivalence tests: one SP training step against a single-device
reference computed on the same rank, reduced to a few error figures."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from slurm_autosp.cluster.layout import ParallelLayout
from slurm_autosp.cluster.parallel_dims import parallel_dims_for
from slurm_autosp.compile import AutoSPBackend, compile_model
from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
from slurm_autosp.config import ActivationCheckpointing
from slurm_autosp.sp import (
    IGNORE_INDEX,
    communication_counts,
    loss_scale,
    prepare_sp_inputs,
    set_sp_group,
    set_sp_groups,
    sp_token_positions,
)

VOCAB = 256
_backends: dict[tuple[int, bool, int], AutoSPBackend] = {}
_sp_groups: dict[int, dist.ProcessGroup] = {}
_ring_groups: dict[tuple[int, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


@dataclass(frozen=True)
class Case:
    """One equivalence scenario; `batch` rows are split over the data-parallel ranks."""

    family: str = "llama"
    kv_heads: int = 2
    seq: int = 128
    batch: int = 2
    labels: str = "plain"  # plain | uneven | first_shard_ignored
    right_padding: bool = False
    left_padding: bool = False
    pass_position_ids: bool = True
    per_layer: bool = False
    window: int | None = None  # mistral: its sliding_window on every layer; qwen2: on layer 1 only
    query_heads: int = 4


def tiny_model(
    family: str,
    kv_heads: int,
    attn_implementation: str = "sdpa",
    layers: int = 2,
    window: int | None = None,
    query_heads: int = 4,
) -> PreTrainedModel:
    """The same weights on every rank and for the reference (fixed seed), in fp32."""
    torch.manual_seed(0)
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=query_heads,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        attn_implementation=attn_implementation,
    )
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(**common, sliding_window=window))
    if window is not None:  # the window on the layers from max_window_layers on
        windowed = dict(use_sliding_window=True, sliding_window=window, max_window_layers=1)
        return Qwen2ForCausalLM(Qwen2Config(**common, **windowed))
    return Qwen2ForCausalLM(Qwen2Config(**common))


def contiguous_sp_group(sp_size: int) -> dist.ProcessGroup:
    """This rank's SP group, SP groups being contiguous ranks (every rank creates every group).
    Data parallelism runs across them; its gradient reduction is emulated over the world."""
    if sp_size not in _sp_groups:
        world = dist.get_world_size()
        groups = [dist.new_group(list(range(s, s + sp_size))) for s in range(0, world, sp_size)]
        _sp_groups[sp_size] = groups[dist.get_rank() // sp_size]
    return _sp_groups[sp_size]


def ulysses_and_ring_groups(ulysses: int, ring: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's Ulysses and ring groups over contiguous SP groups of ulysses x ring ranks, as
    a job's layout places them (parallel_dims_for: rank r of an SP group is Ulysses member
    r % ulysses of ring rank r // ulysses); built once per split, every rank building every group."""
    if (ulysses, ring) not in _ring_groups:
        world, sp = dist.get_world_size(), ulysses * ring
        layout = ParallelLayout.contiguous(world, sp, ring)
        dims = parallel_dims_for(layout, dist.get_rank(), torch.device("cpu"))
        assert dims.ring_group is not None
        _ring_groups[(ulysses, ring)] = (dims.ulysses_group, dims.ring_group)
    return _ring_groups[(ulysses, ring)]


def register_sp_groups(sp_size: int, ring_size: int = 1) -> None:
    """Register this rank's SP groups: contiguous SP groups, split ulysses x ring under a ring."""
    if ring_size == 1:
        set_sp_group(contiguous_sp_group(sp_size))
    else:
        set_sp_groups(*ulysses_and_ring_groups(sp_size // ring_size, ring_size))


# under a ring, what training runs (auto resolves to sac): attention and the ring kept
RING_CHECKPOINTING = ActivationCheckpointSpec(ActivationCheckpointing.sac, budget=0.0)


def backend_for(sp_size: int, per_layer: bool, ring_size: int = 1) -> AutoSPBackend:
    """One backend per layout and process, so Dynamo's cache serves every case that fits."""
    if (sp_size, per_layer, ring_size) not in _backends:
        spec = RING_CHECKPOINTING if ring_size > 1 else None
        _backends[(sp_size, per_layer, ring_size)] = AutoSPBackend(sp_size, spec, ring_size)
    return _backends[(sp_size, per_layer, ring_size)]


def make_batch(case: Case) -> dict[str, torch.Tensor]:
    """The full global batch, identical on every rank."""
    generator = torch.Generator().manual_seed(case.seq * 7 + case.batch)
    input_ids = torch.randint(1, VOCAB, (case.batch, case.seq), generator=generator)
    labels = input_ids.clone()
    if case.labels == "uneven":
        ignored = torch.rand(case.batch, case.seq, generator=generator) < torch.linspace(
            0.9, 0.0, case.seq
        )
        labels[ignored] = IGNORE_INDEX
    batch = {"input_ids": input_ids, "labels": labels}
    if case.right_padding:
        lengths = torch.tensor([case.seq - 9 * (row + 1) for row in range(case.batch)])
        mask = (torch.arange(case.seq)[None] < lengths[:, None]).long()
        batch["input_ids"] = input_ids.masked_fill(mask == 0, 0)
        batch["attention_mask"] = mask
    if case.left_padding:  # as a left-padding tokenizer writes it; nothing predicts from a pad
        lengths = torch.tensor([case.seq - 7 * (row + 1) for row in range(case.batch)])
        mask = (torch.arange(case.seq)[None] >= (case.seq - lengths)[:, None]).long()
        batch["input_ids"] = input_ids.masked_fill(mask == 0, 0)
        batch["attention_mask"] = mask
        labels[torch.arange(case.batch), case.seq - lengths] = IGNORE_INDEX
    if case.pass_position_ids:
        batch["position_ids"] = torch.arange(case.seq).expand(case.batch, case.seq)
    return batch


def _ignore_first_shard(labels: torch.Tensor, shard: int) -> torch.Tensor:
    """Labels whose shifted targets all fall on SP rank 0: that shard has nothing to learn."""
    labels = labels.clone()
    labels[:, : shard + 1] = IGNORE_INDEX
    return labels


def reference_step(
    case: Case, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Single-device loss, per-token losses [B, S] and gradients of the plain HF model."""
    model = tiny_model(case.family, case.kv_heads, window=case.window, query_heads=case.query_heads)
    labels = batch["labels"]
    if "attention_mask" in batch:
        labels = labels.masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
    out = model(**{**batch, "labels": labels}, use_cache=False)
    out.loss.backward()
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    per_token = F.cross_entropy(out.logits.detach().transpose(1, 2), shifted, reduction="none")
    grads = {name: p.grad for name, p in model.named_parameters()}
    return out.loss.detach(), per_token, grads


Reference = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def sp_step(case: Case, sp_size: int, ring_size: int = 1) -> dict[str, float]:
    """One SP step (sp_size = ulysses x `ring_size`) with gradients reduced the way DeepSpeed
    ZeRO-1 does (mean over the world), compared with the reference. Returns relative loss error,
    max per-token error on this rank's shard, and the worst parameter's max|g - g_ref| / max|g_ref|."""
    batch = make_batch(case)
    if case.labels == "first_shard_ignored":
        batch["labels"] = _ignore_first_shard(batch["labels"], -(-case.seq // sp_size))
    reference = reference_step(case, batch)
    model = tiny_model(case.family, case.kv_heads, window=case.window, query_heads=case.query_heads)
    return step_against(model, case.per_layer, batch, reference, sp_size, ring_size)


def step_against(
    model: PreTrainedModel,
    per_layer: bool,
    batch: dict[str, torch.Tensor],
    reference: Reference,
    sp_size: int,
    ring_size: int = 1,
) -> dict[str, float]:
    """Compile `model` for SP, take one step on this rank's rows and shard of the global `batch`
    (rows split over data parallelism, gradients averaged over the world as ZeRO-1 does) and
    compare with the single-device `reference` (loss, per-token losses [B, S], gradients).
    Also returns the ring attention forwards that ran during backward (checkpointing must
    never re-run one) and the backwards."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sp_rank, dp_rank, dp_size = rank % sp_size, rank // sp_size, world // sp_size
    ref_loss, ref_per_token, ref_grads = reference
    batch_rows = batch["input_ids"].shape[0]
    rows = slice(dp_rank * batch_rows // dp_size, (dp_rank + 1) * batch_rows // dp_size)
    local = {key: value[rows] for key, value in batch.items()}
    shard = prepare_sp_inputs(**local, sp_rank=sp_rank, sp_size=sp_size, ring_size=ring_size)
    count = torch.tensor(shard.valid_labels)
    dist.all_reduce(count)

    backend = backend_for(sp_size, per_layer, ring_size)
    compile_model(model, backend, per_layer=per_layer)
    kwargs = shard.model_kwargs(count)
    for name in ("input_ids", "position_ids", "shift_labels"):
        torch._dynamo.mark_dynamic(kwargs[name], 1)
    register_sp_groups(sp_size, ring_size)
    out = model(**kwargs)
    forwards_before_backward = communication_counts.ring_forwards
    backwards_before = communication_counts.ring_backwards
    (out.loss * loss_scale(world, grad_accum=1)).backward()
    backend.require_sdpa_found()

    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    per_token = F.cross_entropy(
        out.logits.detach().transpose(1, 2), shard.shift_labels, reduction="none"
    )
    padded = shard.input_ids.shape[1] * sp_size
    padded_ref = F.pad(ref_per_token, (0, padded - ref_per_token.shape[1]))
    held = sp_token_positions(padded, sp_rank, sp_size, ring_size, shard.cu_seqlens)
    ref_local = padded_ref[rows][:, held]
    grad_error = 0.0
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad)
        param.grad /= world
        reference_grad = ref_grads[name]
        error = (param.grad - reference_grad).abs().max() / reference_grad.abs().max()
        grad_error = max(grad_error, float(error))
    return {
        "loss": float(loss),
        "loss_rel_error": float((loss - ref_loss).abs() / ref_loss.abs()),
        "token_error": float((per_token - ref_local).abs().max()),
        "grad_rel_error": grad_error,
        "finite": bool(torch.isfinite(out.loss)),
        "packed": shard.cu_seqlens is not None,
        "ring_forwards_in_backward": communication_counts.ring_forwards - forwards_before_backward,
        "ring_backwards": communication_counts.ring_backwards - backwards_before,
    }
