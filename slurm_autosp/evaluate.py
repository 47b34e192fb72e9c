"""Held-out evaluation: loss and perplexity on data the run does not train on, under the
training's SP layout. No optimizer step and no gradient (torch.no_grad, the model in eval mode);
the loss is the sum over every valid label of the evaluated samples over their count, the
single-device eval loss, whatever the layout (an MoE's router load-balancing loss left out:
perplexity is the cross-entropy's).

A stop signal ends an evaluation between two batches: every rank agrees on it after each batch
(one all-reduce of a flag), so a stop waits for one batch, not the whole evaluation. A stopped
evaluation reports nothing; training then saves and requeues as after a step."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from slurm_autosp.cluster.parallel_dims import ParallelDims
from slurm_autosp.config import JobConfig
from slurm_autosp.data import SampleSource, open_eval_source
from slurm_autosp.lifecycle.signals import StopRequest
from slurm_autosp.sp import IGNORE_INDEX
from slurm_autosp.sp.chunked_loss import causal_lm_loss
from slurm_autosp.sp.inputs import SPBatch
from slurm_autosp.sp.step import shard_for_rank

if TYPE_CHECKING:
    from tensorboardX import SummaryWriter  # the tracer's, when it writes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean over every valid label of the evaluated samples
    samples: int
    tokens: int  # valid labels
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


@dataclass(frozen=True)
class Evaluator:
    """Evaluates the first `samples` held-out samples: each SP group reads the same sequences
    and keeps its shard, DP groups split the samples; a DP rank short of samples in the last
    round runs one without labels, so every rank runs the same forwards (collectives match)."""

    source: SampleSource
    samples: int
    every: int  # steps between evaluations; 0: only after the last step
    last_step: int
    dims: ParallelDims
    micro_batch: int
    chunk_tokens: int

    def due(self, done: int) -> bool:
        return done == self.last_step or (self.every > 0 and done % self.every == 0)

    def run(self, step: int, model: Any, stop: StopRequest, writer: SummaryWriter | None) -> bool:
        """Evaluate after `step` and report; True when a stop signal ended the evaluation first,
        with nothing reported."""
        result = self.evaluate(model, stop)
        if result is None:
            return True
        self.report(step, result, writer)
        return False

    def evaluate(self, model: Any, stop: StopRequest | None = None) -> EvalResult | None:
        """`model` runs the forward (the engine, or the module itself). None: `stop` was
        requested on some rank, and every rank left after the same batch."""
        started = time.perf_counter()
        module = getattr(model, "module", model)
        was_training = module.training
        module.train(False)
        # The count is 1: each forward returns its label sum; the mean is taken once, at the end.
        device = self.dims.device
        one = torch.ones((), dtype=torch.int64, device=device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        labels = 0
        rounds = range(0, self.samples, self.dims.dp_size * self.micro_batch)
        try:
            with torch.no_grad():
                for done, first in enumerate(rounds, 1):
                    batch = self._shard(first)
                    loss = causal_lm_loss(
                        model, batch.model_kwargs(one), chunk_tokens=self.chunk_tokens
                    )
                    loss_sum += loss.double()
                    labels += batch.valid_labels
                    if stop is not None and _any_rank(stop.requested, device):
                        log.info("evaluation stopped after %d of %d batches", done, len(rounds))
                        return None
        finally:
            module.train(was_training)
        labels_seen = torch.tensor(labels, dtype=torch.float64, device=device)
        totals = torch.stack([loss_sum, labels_seen])
        # every SP rank holds a part of each sequence's labels: sum over the whole world
        dist.all_reduce(totals)
        count = int(totals[1])
        return EvalResult(
            loss=float(totals[0] / max(count, 1)),
            samples=self.samples,
            tokens=count,
            seconds=time.perf_counter() - started,
        )

    def _shard(self, first: int) -> SPBatch:
        """This rank's shard of its micro-batch of the round starting at sample `first`."""
        dims = self.dims
        start = first + dims.dp_rank * self.micro_batch
        ids, labels, documents = [], [], []
        for index in range(start, start + self.micro_batch):
            sample = self.source.sample(index % self.samples)
            ids.append(sample.input_ids)
            target = sample.input_ids if sample.labels is None else sample.labels
            labels.append(target if index < self.samples else torch.full_like(target, IGNORE_INDEX))
            if sample.document_ids is not None:  # data.documents=masked
                documents.append(sample.document_ids)
        return shard_for_rank(
            dims,
            torch.stack(ids),
            torch.stack(labels),
            torch.stack(documents) if documents else None,
        )

    def report(self, step: int, result: EvalResult, writer: SummaryWriter | None) -> None:
        """Rank 0: one log line, and eval/loss, eval/perplexity in TensorBoard."""
        if self.dims.rank != 0:
            return
        log.info(
            "eval at step %d | loss %.4f | perplexity %.2f | %d samples, %d tokens | %.3f s",
            step,
            result.loss,
            result.perplexity,
            result.samples,
            result.tokens,
            result.seconds,
        )
        if writer is not None:
            writer.add_scalar("eval/loss", result.loss, step)
            writer.add_scalar("eval/perplexity", result.perplexity, step)


def _any_rank(flag: bool, device: torch.device) -> bool:
    """Collective: whether `flag` is true on any rank."""
    flags = torch.tensor([int(flag)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0])


def build_evaluator(cfg: JobConfig, dims: ParallelDims, vocab_size: int | None) -> Evaluator | None:
    """None when the run has no held-out data or train.eval_samples=0. At most
    `train.eval_samples` samples: a smaller held-out set is evaluated whole."""
    source = open_eval_source(cfg, vocab_size)
    if source is None:
        return None
    return Evaluator(
        source=source,
        samples=min(cfg.train.eval_samples, source.num_samples),
        every=cfg.train.eval_every,
        last_step=cfg.train.steps,
        dims=dims,
        micro_batch=cfg.train.micro_batch,
        chunk_tokens=cfg.compile.loss_chunk_tokens,
    )
