"""One executor for every schedule: it runs this stage's list of actions in order.

    F(c, m): input = micro-batch tokens (chunk 0; or a `Call`, a batch as the model takes it,
             with one stage) or the activation received from chunk c - 1's stage, with the
             micro-batch's documents on every chunk (a third entry, `data.document_mask`:
             every stage has the micro-batches, so they never travel); output sent
             on to chunk c + 1's stage, or the loss computed (last chunk): `loss_fn(output,
             target)`, or with no target the model's own (`batch.model_loss`).
    B(c, m): gradient received from chunk c + 1's stage (or the loss itself on the last chunk);
             backward; the input's gradient sent to chunk c - 1's stage. Under a split backward,
             B computes the input gradient only and keeps the graph for W.
    W(c, m): the weight gradients of the kept graph.

Sends are asynchronous and receives block, each message tagged by (direction, chunk,
micro-batch), so any schedule that passes `simulator.check` runs without deadlock. Activation
shapes are known up front (`Activation`): (micro-batch rows, seq / T under sequence parallelism,
dim), in the dtype of the residual stream.

With one stage the schedule is F B F B ...: gradient accumulation, the data-parallel engine's
`no_sync` around every backward but the last.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed import ProcessGroup

from plait.comm import Pending, recv, send
from plait.comm.trace import PIPELINE, TRACER
from plait.parallel.batch import Call, model_loss, to_device
from plait.parallel.pipeline.schedules import Kind, Schedule


@dataclass
class _Saved:
    input: torch.Tensor
    output: torch.Tensor  # activation, or the scaled loss on the last chunk
    grad: torch.Tensor | None = None  # gradient of `output`, kept for W under a split backward


@dataclass(frozen=True)
class Activation:
    """What travels between chunks: (rows, seq // seq_shards, dim) of `dtype`."""

    dim: int
    seq_shards: int = 1  # tp under sequence parallelism: chunks exchange sequence shards
    dtype: torch.dtype = torch.float32


class PipelineExecutor:
    def __init__(
        self,
        schedule: Schedule,
        chunks: dict[int, nn.Module],  # this stage's chunks by global chunk index
        group: ProcessGroup,  # the pp axis: rank i of the group is stage i
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        activation: Activation,
        device: torch.device,
        no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
        compute: Callable[[], contextlib.AbstractContextManager] | None = None,
    ):
        self.schedule, self.chunks, self.group = schedule, chunks, group
        self.loss_fn, self.activation, self.device = loss_fn, activation, device
        self.no_sync = no_sync or contextlib.nullcontext
        self.compute = compute or contextlib.nullcontext  # e.g. bf16 autocast around forwards
        self.loss_scale = 1.0  # fp16: what backward multiplies the loss by (set each step)
        # The action that produces each chunk's gradients last: only it may communicate them.
        grad_kind = Kind.W if schedule.split_backward else Kind.B
        self.final = {}
        for a in schedule.actions[next(iter(chunks)) % schedule.stages]:
            if a.kind is grad_kind:
                self.final[a.chunk] = a

    def _tag(self, backward: bool, chunk: int, microbatch: int) -> int:
        return (chunk * self.schedule.microbatches + microbatch) * 2 + backward

    def run(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Execute this stage's actions over the micro-batches; returns the sum of the losses
        computed here, each divided by the number of micro-batches and not by `loss_scale` (0 on
        stages without the last chunk). Each action is traced (when tracing) from the end of its
        receive, so the waiting shows as idle in the timeline."""
        s = self.schedule
        saved: dict[tuple[int, int], _Saved] = {}
        sends: list[tuple[Pending, torch.Tensor]] = []
        losses: list[torch.Tensor] = []  # read once the schedule is done: one host sync
        stage = next(iter(self.chunks)) % s.stages
        for a in s.actions[stage]:
            if a.kind is Kind.F:
                loss, start = self._forward(a, microbatches, saved, sends)
                if loss is not None:
                    losses.append(loss)
            elif a.kind is Kind.B:
                start = self._backward(a, saved, sends)
            else:
                start = self._weights(a, saved)
            TRACER.complete(f"{a.kind.value}{a.microbatch}", PIPELINE, start, time.perf_counter(),
                            kind=a.kind.value, microbatch=a.microbatch, chunk=a.chunk)
        for pending, _ in sends:
            pending.wait()
        return sum(loss.item() for loss in losses)

    def _forward(self, a, microbatches: list, saved: dict,
                 sends: list) -> tuple[torch.Tensor | None, float]:
        """F: the chunk's input (the micro-batch on chunk 0, else received from the previous
        chunk's stage), its forward, then the loss (last chunk) or a send to the next stage.
        Returns (this micro-batch's loss, detached, on the device; None on other chunks and in
        a traced step; when the work began)."""
        s, M, loss = self.schedule, len(microbatches), None
        first = microbatches[a.microbatch][0]
        if isinstance(first, Call):  # a batch as the model takes it (one stage)
            x = first
        elif a.chunk == 0:
            x = first.to(self.device)
        else:
            act = self.activation
            rows, seq = first.shape  # tokens (a plan's model)
            x = torch.empty(rows, seq // act.seq_shards, act.dim, dtype=act.dtype,
                            device=self.device)
            recv(x, s.stage_of(a.chunk - 1), self.group,
                 tag=self._tag(False, a.chunk - 1, a.microbatch))
            x.requires_grad_()
        start = time.perf_counter()  # busy from here: waiting for the message is idle
        documents = microbatches[a.microbatch][2] if len(microbatches[a.microbatch]) > 2 \
            else None
        last = a.chunk == s.chunks - 1
        target = microbatches[a.microbatch][1] if last else None
        # The last chunk computes a fusable loss itself, from the head's input (the logits
        # never whole: `vocab_parallel.linear_cross_entropy`).
        fused = target is not None and not isinstance(x, Call) and hasattr(self.loss_fn, "fused")
        kwargs = {} if documents is None else {"documents": documents}
        if fused:
            kwargs["head_loss"] = functools.partial(self.loss_fn.fused,
                                                    targets=to_device(target, self.device))
        with self.compute():
            if isinstance(x, Call):
                out = x(self.chunks[a.chunk], self.device)
            else:
                out = self.chunks[a.chunk](x, **kwargs)
        if last:
            out = (out if fused else model_loss(out) if target is None
                   else self.loss_fn(out, to_device(target, self.device))) / M
            loss = None if is_fake(out) else out.detach()  # fake: a traced step
            if self.loss_scale != 1.0:  # fp16: backward from the scaled loss
                out = out * self.loss_scale
        else:
            out = out.to(self.activation.dtype).contiguous()
            sent = out.detach()
            sends.append((send(sent, s.stage_of(a.chunk + 1), self.group, async_op=True,
                               tag=self._tag(False, a.chunk, a.microbatch)), sent))
        saved[(a.chunk, a.microbatch)] = _Saved(x, out)
        return loss, start

    def _backward(self, a, saved: dict, sends: list) -> float:
        """B: the output's gradient (received from the next chunk's stage, but on the last
        chunk), the backward (under a split backward the input's gradient only, the graph kept
        for W), the input's gradient sent to the previous stage. Returns when the work began."""
        s, key = self.schedule, (a.chunk, a.microbatch)
        item, grad = saved[key], None
        if a.chunk < s.chunks - 1:
            grad = torch.empty_like(item.output)
            recv(grad, s.stage_of(a.chunk + 1), self.group,
                 tag=self._tag(True, a.chunk + 1, a.microbatch))
        start = time.perf_counter()
        if s.split_backward:
            item.grad = grad
            if a.chunk > 0:  # input gradient only; the graph is kept for W
                torch.autograd.backward(item.output, grad, inputs=[item.input],
                                        retain_graph=True)
        else:
            with contextlib.nullcontext() if self.final[a.chunk] == a else self.no_sync():
                torch.autograd.backward(item.output, grad)
            del saved[key]
        if a.chunk > 0:
            g = item.input.grad.contiguous()
            sends.append((send(g, s.stage_of(a.chunk - 1), self.group, async_op=True,
                               tag=self._tag(True, a.chunk, a.microbatch)), g))
        return start

    def _weights(self, a, saved: dict) -> float:
        """W (a split backward): the parameters' gradients from the graph B kept. Returns when
        the work began."""
        start = time.perf_counter()
        item = saved.pop((a.chunk, a.microbatch))
        params = [p for p in self.chunks[a.chunk].parameters() if p.requires_grad]
        with contextlib.nullcontext() if self.final[a.chunk] == a else self.no_sync():
            torch.autograd.backward(item.output, item.grad, inputs=params)
        # Free the graph now, not at the next action: its nodes on the input's path alone
        # (run by B, not by this pass) still hold their saved tensors.
        del item
        return start
