"""Check, before spending GPU hours, that AutoSP trains your model exactly as one device would.

    python -m slurm_autosp.verify cfg=configs/llama8b_32k.yaml parallel.sp_size=4
    python -m slurm_autosp.verify cfg=configs/tiny_cpu.yaml parallel.sp_size=2 compile.enabled=true --dp 2

The configured model is shrunk to a CPU-sized copy with the same head layout (the same
num_attention_heads and num_key_value_heads, hence the same grouped-query ratio and the same
way heads split over the SP ranks), the same model class, RoPE settings and compile mode
(compile.per_layer), but 2 layers, head_dim 8 and a 256-token vocabulary. Then
parallel.sp_size x dp local CPU ranks (gloo) run one AutoSP training step in fp32, on a batch
whose sequence length is not divisible by the SP size and whose ignored labels are spread
unevenly over the shards, and one device runs the plain model on the same batch. Gradients
are averaged over all ranks, as DeepSpeed ZeRO-1 does, with slurm_autosp.compile.loss_scale.

Printed: the loss of both, the largest per-token loss difference, and for every parameter
max|g - g_ref| / max|g_ref| (the worst few named). Exit status 0 when every figure is at most
the tolerance (1e-5), 1 when one is not, 2 for a bad configuration or a failed rank.

Arguments:
  cfg=PATH.yaml           the job config, with any key=value overrides, as for submit
                          (e.g. parallel.sp_size=2 to check fewer ranks than the config asks)
  --dp N                  also run N data-parallel replicas (world = sp_size x N); verify.dp=N
  verify.layers=2         decoder layers of the shrunk copy
  verify.head_dim=8       head dimension of the shrunk copy (hidden = heads x head_dim)
  verify.vocab_size=256   vocabulary of the shrunk copy
  verify.seq_len=0        tokens per sequence; 0 picks 32 x sp_size - 3 (not divisible by SP)
  verify.rows=2           sequences per data-parallel rank
  verify.tolerance=1e-5   the largest relative error that passes
  verify.seed=0           weights and batch
  verify.inject=none      testing hook: per_shard_shift shifts labels inside each shard, the
                          shard-boundary bug of other SP implementations; verify must then fail
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from slurm_autosp.cli import arguments, config_error
from slurm_autosp.config import ConfigError, JobConfig, ModelConfig, load_config
from slurm_autosp.model import refuse_unsupported_attention


class Inject(str, enum.Enum):
    none = "none"
    per_shard_shift = "per_shard_shift"


@dataclass
class VerifyOptions:
    """The `verify.*` keys: the size of the check, not of the job."""

    dp: int = 1
    layers: int = 2
    head_dim: int = 8
    vocab_size: int = 256
    seq_len: int = 0  # 0: 32 * sp_size - 3
    rows: int = 2
    tolerance: float = 1e-5
    seed: int = 0
    inject: Inject = Inject.none


@dataclass
class Report:
    """What rank 0 measured; `format_report` and `failures` read it."""

    description: str
    sp_size: int
    seq_len: int
    shard_len: int
    loss: float
    ref_loss: float
    token_error: float
    mismatched_positions: list[int]  # sequence positions whose per-token loss differs
    grad_errors: dict[str, float] = field(default_factory=dict)  # parameter -> relative error

    @property
    def loss_error(self) -> float:
        return abs(self.loss - self.ref_loss) / max(abs(self.ref_loss), 1e-30)


# ---------------------------------------------------------------------------- deciding logic


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate job-config arguments from `verify.*` ones (`--dp N` is `verify.dp=N`)."""
    job, verify = [], []
    args = iter(argv)
    for arg in args:
        if arg == "--dp":
            value = next(args, None)
            if value is None:
                raise ConfigError("--dp needs a number of data-parallel replicas, e.g. --dp 2")
            verify.append(f"dp={value}")
        elif arg.startswith("--dp="):
            verify.append(f"dp={arg[len('--dp=') :]}")
        elif arg.startswith("verify."):
            verify.append(arg[len("verify.") :])
        else:
            job.append(arg)
    return job, verify


def load_options(overrides: list[str]) -> VerifyOptions:
    try:
        merged = OmegaConf.merge(
            OmegaConf.structured(VerifyOptions), OmegaConf.from_dotlist(overrides)
        )
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        known = ", ".join(f.name for f in dataclasses.fields(VerifyOptions))
        raise ConfigError(
            f"verify.{key}: {str(err).splitlines()[0]} Known verify keys: {known}"
        ) from err
    options = OmegaConf.to_object(merged)
    assert isinstance(options, VerifyOptions)
    for key in ("dp", "layers", "head_dim", "vocab_size", "rows"):
        if getattr(options, key) < 1:
            raise ConfigError(f"verify.{key}={getattr(options, key)} must be >= 1")
    if options.head_dim % 2:
        raise ConfigError(
            f"verify.head_dim={options.head_dim} must be even (rotary embeddings pair dimensions)"
        )
    if options.seq_len < 0:
        raise ConfigError(f"verify.seq_len={options.seq_len} must be >= 0 (0 picks one)")
    return options


def _hf_config_of(model: ModelConfig) -> dict[str, Any]:
    """The model's HF config fields: from its local checkpoint, or from the job config."""
    if not model.pretrained_path:
        return {"model_type": model.model_type, **model.hf_fields()}
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(model.pretrained_path).to_dict()
    keep_out = {
        "architectures",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "_name_or_path",
        "auto_map",
    }
    return {key: value for key, value in loaded.items() if key not in keep_out}


SPECIAL_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _special_ids_within(fields: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """The model's pad/bos/eos ids (its own or its HF class's defaults, e.g. Phi-3's pad 32000)
    that fall outside the shrunk vocabulary, mapped to its last id: they would not embed."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        fields["model_type"], **{k: v for k, v in fields.items() if k != "model_type"}
    )
    moved: dict[str, Any] = {}
    for key in SPECIAL_TOKEN_IDS:
        value = getattr(config, key, None)
        ids = value if isinstance(value, list) else [value]
        if any(i is not None and i >= vocab_size for i in ids):
            within = [i if i is None else min(i, vocab_size - 1) for i in ids]
            moved[key] = within if isinstance(value, list) else within[0]
    return moved


def shrink_model_config(model: ModelConfig, options: VerifyOptions) -> ModelConfig:
    """A CPU-sized copy of `model` with the same head layout, class and RoPE settings.

    A model from `builder` gets the shrunk fields and must honour them; a `pretrained_path`
    model is rebuilt from its config with random weights (equivalence is a property of the
    architecture, not of the weights).
    """
    fields = _hf_config_of(model)
    heads = fields.get("num_attention_heads")
    if not heads:
        raise ConfigError(
            "model.num_attention_heads is needed to shrink the model with the same head layout"
        )
    kv_heads = fields.get("num_key_value_heads") or heads
    hidden = heads * options.head_dim
    shrunk = {
        "vocab_size": min(fields.get("vocab_size") or options.vocab_size, options.vocab_size),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": min(fields.get("num_hidden_layers") or options.layers, options.layers),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": options.head_dim,
    }
    typed = {f.name for f in dataclasses.fields(ModelConfig)}
    extra = {k: v for k, v in fields.items() if k not in typed and k not in shrunk}
    extra.update({k: v for k, v in model.extra.items() if k not in shrunk})
    extra.update(_special_ids_within(fields, shrunk["vocab_size"]))
    kept = {k: v for k, v in fields.items() if k in typed and k not in shrunk and k != "extra"}
    kept.pop("model_type", None)
    return dataclasses.replace(
        model,
        **kept,
        **shrunk,
        model_type=fields.get("model_type") or model.model_type,
        pretrained_path=None,
        extra=extra,
    )


def verify_seq_len(sp_size: int, options: VerifyOptions) -> int:
    return options.seq_len or 32 * sp_size - 3


def failures(report: Report, tolerance: float) -> list[str]:
    """One line per figure above the tolerance, naming what differs and, where the pattern
    shows it, the likely cause."""
    problems = []
    if not math.isfinite(report.loss) or report.loss_error > tolerance:
        problems.append(
            f"loss {report.loss:.6f} vs single-device {report.ref_loss:.6f} (relative error {report.loss_error:.1e})"
        )
    if not report.token_error <= tolerance:
        positions = report.mismatched_positions
        line = (
            f"per-token loss differs by up to {report.token_error:.1e} at {len(positions)} sequence "
            f"position(s) {_short(positions)}"
        )
        if positions and all(p % report.shard_len == report.shard_len - 1 for p in positions):
            line += (
                f": all are the last token of an SP shard (shard length {report.shard_len}), so the label "
                "pair crossing each shard boundary is lost; labels must be shifted once over the whole "
                "sequence before sharding (prepare_sp_inputs), not inside each shard"
            )
        problems.append(line)
    bad = {name: e for name, e in report.grad_errors.items() if not e <= tolerance}
    if bad:
        worst = sorted(bad, key=lambda n: -bad[n] if math.isfinite(bad[n]) else -math.inf)[:3]
        named = ", ".join(f"{n} ({bad[n]:.1e})" for n in worst)
        problems.append(
            f"gradients of {len(bad)} of {len(report.grad_errors)} parameters differ, worst: {named}"
        )
    return problems


def _short(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def format_report(report: Report, tolerance: float, worst: int = 5) -> str:
    def row(what: str, value: str, error: float) -> str:
        verdict = "ok" if error <= tolerance else "MISMATCH"
        return f"  {what:<48} {value:>12} {error:>12.2e}  {verdict}"

    ranked = sorted(
        report.grad_errors.items(),
        key=lambda item: -item[1] if math.isfinite(item[1]) else -math.inf,
    )
    worst_grad = ranked[0][1] if ranked else 0.0
    lines = [
        report.description,
        f"  {'':<48} {'value':>12} {'error':>12}  (limit {tolerance:.0e})",
        f"  {'loss, single device fp32':<48} {report.ref_loss:>12.6f}",
        row(
            f"loss, AutoSP sp_size={report.sp_size} (relative error)",
            f"{report.loss:.6f}",
            report.loss_error,
        ),
        row("per-token loss, max |l - l_ref|", "", report.token_error),
        row(f"gradients, worst of {len(ranked)} parameters", "", worst_grad),
        "    max|g - g_ref| / max|g_ref|, worst parameters:",
    ]
    lines += [f"      {name:<58} {error:.2e}" for name, error in ranked[:worst]]
    problems = failures(report, tolerance)
    if problems:
        lines.append(f"FAIL: AutoSP does not match single-device training within {tolerance:.0e}:")
        lines += [f"  - {p}" for p in problems]
    else:
        lines.append(
            f"PASS: AutoSP sp_size={report.sp_size} matches single-device fp32 training within {tolerance:.0e}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- every rank


def force_full_fp32() -> None:
    """No TF32 or reduced-precision matmuls: the comparison is against exact fp32."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def make_batch(rows: int, seq_len: int, vocab_size: int, seed: int) -> dict[str, Any]:
    """Random tokens, with ignored labels thinning out along the sequence (90% ignored at the
    start, none at the end), so SP shards hold very different numbers of valid labels."""
    import torch

    from slurm_autosp.compile import IGNORE_INDEX

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab_size, (rows, seq_len), generator=generator)
    labels = input_ids.clone()
    ignored = torch.rand(rows, seq_len, generator=generator) < torch.linspace(0.9, 0.0, seq_len)
    labels[ignored] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels}


def shift_labels_per_shard(labels: Any, sp_rank: int, sp_size: int) -> Any:
    """THE BUG verify must catch: shard the labels first, then shift inside the shard. The last
    token of every shard loses its target (the first token of the next shard)."""
    import torch
    import torch.nn.functional as F

    from slurm_autosp.compile import IGNORE_INDEX

    padded = F.pad(labels, (0, -labels.shape[1] % sp_size), value=IGNORE_INDEX)
    shard = padded.shape[1] // sp_size
    local = padded[:, sp_rank * shard : (sp_rank + 1) * shard]
    return torch.cat(
        [local[:, 1:], torch.full_like(local[:, :1], IGNORE_INDEX)], dim=1
    ).contiguous()


def _per_token_loss(logits: Any, shift_labels: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.detach().float().transpose(1, 2), shift_labels, reduction="none")


def _reference(model: Any, batch: dict[str, Any]) -> tuple[float, Any, dict[str, Any]]:
    """The plain model on one device: loss, per-token losses [B, S], gradients."""
    import torch

    from slurm_autosp.compile import IGNORE_INDEX

    labels = batch["labels"]
    out = model(input_ids=batch["input_ids"], labels=labels, use_cache=False)
    out.loss.backward()
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return float(out.loss.detach()), _per_token_loss(out.logits, shifted), grads


def run_rank(
    rank: int,
    world_size: int,
    cfg: JobConfig,
    options: VerifyOptions,
    init_file: str,
    result_file: str,
) -> None:
    """One rank: an AutoSP step on its shard, gradients averaged over the world; rank 0 also
    runs the reference and writes the report."""
    import torch
    import torch.distributed as dist

    from slurm_autosp.compile import (
        AutoSPBackend,
        compile_model,
        loss_scale,
        prepare_sp_inputs,
        set_sp_group,
    )
    from slurm_autosp.model import build_model

    torch.set_num_threads(1)
    force_full_fp32()
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        sp_size = cfg.parallel.sp_size
        sp_rank, dp_rank = rank % sp_size, rank // sp_size
        sp_groups = [
            dist.new_group(list(range(s, s + sp_size))) for s in range(0, world_size, sp_size)
        ]
        model_cfg = shrink_model_config(cfg.model, options)
        seq_len = verify_seq_len(sp_size, options)
        assert model_cfg.vocab_size is not None  # shrink_model_config sets it
        batch = make_batch(options.rows * options.dp, seq_len, model_cfg.vocab_size, options.seed)

        torch.manual_seed(options.seed)
        model = build_model(model_cfg).float()
        reference_model = copy.deepcopy(model) if rank == 0 else None

        rows = slice(dp_rank * options.rows, (dp_rank + 1) * options.rows)
        local = {key: value[rows] for key, value in batch.items()}
        shard = prepare_sp_inputs(**local, sp_rank=sp_rank, sp_size=sp_size)
        if options.inject is Inject.per_shard_shift:
            buggy = shift_labels_per_shard(local["labels"], sp_rank, sp_size)
            shard = dataclasses.replace(
                shard, shift_labels=buggy, valid_labels=int((buggy != -100).sum())
            )
        count = torch.tensor(shard.valid_labels)
        dist.all_reduce(count)

        backend = AutoSPBackend(sp_size)
        compile_model(model, backend, per_layer=cfg.compile.per_layer)
        set_sp_group(sp_groups[dp_rank])
        out = model(**shard.model_kwargs(count.clamp(min=1)))
        (out.loss * loss_scale(world_size, grad_accum=1)).backward()
        backend.require_sdpa_found()

        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        per_token = _per_token_loss(out.logits, shard.shift_labels).contiguous()
        gathered = [torch.empty_like(per_token) for _ in range(world_size)]
        dist.all_gather(gathered, per_token)
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            dist.all_reduce(grad)
            grads[name] = grad / world_size
        if rank != 0:
            return

        ref_loss, ref_per_token, ref_grads = _reference(reference_model, batch)
        # gathered[rank] is (dp_rank, sp_rank)'s [rows, shard]: rows by DP, sequence by SP
        replicas = [
            torch.cat(gathered[d * sp_size : (d + 1) * sp_size], dim=1) for d in range(options.dp)
        ]
        full = torch.cat(replicas, dim=0)
        token_diff = (full[:, :seq_len] - ref_per_token).abs()
        mismatched = sorted(
            {int(p) for p in (token_diff > options.tolerance).nonzero()[:, 1].tolist()}
        )
        grad_errors = {}
        for name, reference in ref_grads.items():
            scale = reference.abs().max().clamp(min=1e-30)
            grad_errors[_short_name(name)] = float((grads[name] - reference).abs().max() / scale)
        report = Report(
            description=_describe(cfg, model_cfg, options, seq_len, count=int(count), batch=batch),
            sp_size=sp_size,
            seq_len=seq_len,
            shard_len=shard.input_ids.shape[1],
            loss=float(loss),
            ref_loss=ref_loss,
            token_error=float(token_diff.max()),
            mismatched_positions=mismatched,
            grad_errors=grad_errors,
        )
        torch.save(dataclasses.asdict(report), result_file)
    finally:
        dist.destroy_process_group()


def _short_name(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def _describe(
    cfg: JobConfig,
    model: ModelConfig,
    options: VerifyOptions,
    seq_len: int,
    count: int,
    batch: dict[str, Any],
) -> str:
    sp = cfg.parallel.sp_size
    injected = (
        f"; INJECTED BUG: {options.inject.value}" if options.inject is not Inject.none else ""
    )
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    assert heads is not None and kv is not None  # shrink_model_config sets both
    padded = seq_len + (-seq_len % sp)
    return (
        f"AutoSP verify: {model.model_type}, {heads} query heads / {kv} KV heads (GQA {heads // kv}:1), shrunk to "
        f"{model.num_hidden_layers} layers, head_dim {model.head_dim}, hidden {model.hidden_size}, "
        f"vocab {model.vocab_size}\n"
        f"  sp_size={sp} x dp={options.dp} local CPU ranks (gloo), fp32, "
        f"compile.per_layer={cfg.compile.per_layer}; batch {batch['input_ids'].shape[0]} x {seq_len} tokens "
        f"(padded to {padded} = {sp} shards of {padded // sp}), {count} valid labels{injected}"
    )


# ---------------------------------------------------------------------------- the command


def run_verify(cfg: JobConfig, options: VerifyOptions) -> Report:
    """Spawn sp_size x dp CPU ranks, run the check, return rank 0's report."""
    import torch
    import torch.multiprocessing as mp

    world_size = cfg.parallel.sp_size * options.dp
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="autosp_verify_") as tmp:
        result_file = os.path.join(tmp, "report.pt")
        mp.spawn(
            run_rank,
            args=(world_size, cfg, options, os.path.join(tmp, "store"), result_file),
            nprocs=world_size,
        )
        return Report(**torch.load(result_file, weights_only=False))


def main(argv: list[str] | None = None) -> int:
    argv = arguments(argv, __doc__)
    if argv is None:
        return 0
    try:
        job_args, verify_args = split_arguments(argv)
        options = load_options(verify_args)
        cfg = load_config(job_args)
        refuse_unsupported_attention(cfg)  # as submit would
        refuse_unsupported_attention(cfg, verify_seq_len(cfg.parallel.sp_size, options))
    except ConfigError as err:
        return config_error(err)
    if cfg.parallel.sp_size == 1:
        print(
            "note: parallel.sp_size=1, so nothing is split; pass parallel.sp_size=N to check N-way SP",
            flush=True,
        )
    seq_len = verify_seq_len(cfg.parallel.sp_size, options)
    if cfg.parallel.sp_size > 1 and seq_len % cfg.parallel.sp_size == 0:
        print(
            f"note: verify.seq_len={seq_len} divides by sp_size; the padding path is not exercised",
            flush=True,
        )
    start = time.perf_counter()
    try:
        report = run_verify(cfg, options)
    except Exception as err:  # a rank failed (torch.multiprocessing carries its traceback)
        print(
            f"{err}\nerror: a verify rank failed: {str(err).strip().splitlines()[-1]}",
            file=sys.stderr,
        )
        return 2
    print(format_report(report, options.tolerance))
    print(f"({cfg.parallel.sp_size * options.dp} ranks, {time.perf_counter() - start:.1f} s)")
    return 1 if failures(report, options.tolerance) else 0


if __name__ == "__main__":
    sys.exit(main())
