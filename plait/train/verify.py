"""`plait train --verify` (and `Prepared.verify` from Python): is this layout, with this model's
plan, computing what one process computes?

One step of the configured layout and one of a single process, from the same weights and the
same global batch: the parallel run's forward and backward through its schedule and its
data-parallel engine's gradient reduction (no optimizer step), and the unsplit copy of the model
on the whole batch. Every rank compares the averaged gradient it holds (a tensor-parallel shard,
a ZeRO slice, a pipeline stage's parameters) with the same elements of the reference's; the
largest differences are reduced over the world and reported per parameter group (a parameter
name with its block index replaced by `*`), relative to the group's largest reference gradient.

Tolerance (the default): float32 layouts differ from one process by summation order only: the
loss within 1e-5 relative, each group's gradients within 1e-4 of the group's largest element. A
plan that splits a linear along the wrong dim, forgets a partial gradient's sum, or drops a
module is off by the size of the gradients themselves. bf16 rounds every matmul to 8 bits:
2e-2 for both.

Dropout is off in both for the step (`parallel/dropout.dropout_off`): a layout draws its masks in
other places and from other streams than one process, so with dropout the two steps differ by
design; the verdict says how many dropouts it switched off.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ReduceOp

from plait.comm import all_reduce
from plait.mesh import Axis
from plait.model.documents import Documents
from plait.optim.loss_scaling import HALF
from plait.parallel.dropout import dropout_off
from plait.parallel.embedding_grad import sum_embedding_grads_in_fp32


@dataclass
class Verdict:
    loss: float  # the parallel run's, averaged over the ranks
    reference_loss: float
    groups: dict[str, tuple[float, float]]  # group -> (largest |difference|, largest |gradient|)
    tolerance: float
    dropouts_off: int = 0  # dropouts (modules or rates) that were on and were set to 0

    @property
    def loss_error(self) -> float:
        return abs(self.loss - self.reference_loss) / max(abs(self.reference_loss), 1e-12)

    def relative(self) -> dict[str, float]:
        """Each group's largest difference over what it is judged against: its own largest
        gradient, or, where that is below `tolerance` of the whole model's largest, that share. A
        gradient so small is rounding (a key projection's bias, zero in exact arithmetic: softmax
        ignores what it adds to every score), and its difference is rounding of the same size."""
        floor = self.tolerance * max((scale for _, scale in self.groups.values()), default=0.0)
        return {g: diff / max(scale, floor, 1e-12) for g, (diff, scale) in self.groups.items()}

    def failures(self) -> list[str]:
        bad = [g for g, r in self.relative().items() if r > self.tolerance]
        return (["loss"] if self.loss_error > self.tolerance / 10 else []) + bad

    def table(self) -> str:
        lines = [f"loss {self.loss:.6f}, one process {self.reference_loss:.6f} (relative "
                 f"difference {self.loss_error:.2e})",
                 f"{'parameter group':<48} {'max |diff|':>11} {'max |grad|':>11} {'relative':>9}"]
        relative = self.relative()
        for group, (diff, scale) in self.groups.items():
            lines.append(f"{group:<48} {diff:11.3e} {scale:11.3e} {relative[group]:9.2e}")
        if self.dropouts_off:
            lines.append(f"dropout off for the comparison ({self.dropouts_off} of the model's "
                         "dropouts): a layout draws other masks than one process")
        failed = self.failures()
        lines.append(f"verify: {'FAILED: ' + ', '.join(failed) if failed else 'ok'} (tolerance "
                     f"{self.tolerance:g} of each group's largest gradient, at least of "
                     f"{self.tolerance:g} of the model's; loss {self.tolerance / 10:g})")
        return "\n".join(lines)


def held_as_the_layout(reference: nn.Module, held: str) -> nn.Module:
    """`reference` with its parameters in the dtype the layout holds its own in (`held`, from
    `held_precision`: under ZeRO a half `train.precision` holds them in it), so that one process
    computes what the layout computes: a bf16 weight's products, not autocast's casts of an fp32
    one, and its embeddings' gradients summed as the layout sums them (`embedding_grad.py`).
    Buffers stay as built."""
    if held in HALF:
        for p in reference.parameters():
            p.data = p.data.to(HALF[held])
    sum_embedding_grads_in_fp32(reference)  # as `parallelize` makes the layout's
    return reference


def group_of(name: str) -> str:
    """`layers.3.attention.wq.weight` -> `layers.*.attention.wq.weight`."""
    return re.sub(r"\.\d+\.", ".*.", name)


def verify_step(parallelized, reference: nn.Module, local: list[tuple[torch.Tensor, torch.Tensor]],
                inputs: torch.Tensor, targets: torch.Tensor,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                global_mean: Callable[[float], float], tolerance: float, world: Axis,
                documents: torch.Tensor | None = None) -> Verdict:
    """One step of `parallelized` on this rank's micro-batches `local` and one of `reference`
    (the whole model, same weights) on the global batch (`inputs`, `targets`, and the inputs'
    `documents` under `data.document_mask`), dropout off in both; their gradients compared,
    every rank the part it holds. Leaves gradients in both; steps neither."""
    with dropout_off(parallelized.module), dropout_off(reference) as turned_off:
        parallelized.module.zero_grad(set_to_none=True)
        loss = global_mean(parallelized.pipeline.run(local))
        parallelized.finish_gradients()
        reference.zero_grad(set_to_none=True)
        outputs = reference(inputs) if documents is None else \
            reference(inputs, documents=Documents.whole(documents))
        ref_loss = loss_fn(outputs, targets)
        ref_loss.backward()
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    names = [n for n, _ in reference.named_parameters()]
    groups = list(dict.fromkeys(group_of(n) for n in names))
    diff = torch.zeros(len(groups), dtype=torch.float64)
    scale = torch.zeros(len(groups), dtype=torch.float64)
    record = parallelized.record
    pieces = parallelized.engine.held_pieces()
    held = list(parallelized.engine.grad_pieces())
    if [p.name for p in pieces] != [n for n, _ in held]:
        raise RuntimeError("verify: the engine's gradient pieces do not line up with what it "
                           "holds")
    for piece, (name, grad) in zip(pieces, held, strict=True):
        want = grads[name]
        shard = record.params[name].shards.get("tp")
        if shard is not None and shard.dim is not None:
            want = want.chunk(shard.count, dim=shard.dim)[shard.index]
        want = want.reshape(-1)[piece.start : piece.start + piece.numel]
        got = grad.reshape(-1)[: piece.numel]
        g = groups.index(group_of(name))
        diff[g] = max(diff[g], (got.double().cpu() - want.double().cpu()).abs().max().item())
    for name, g in grads.items():
        k = groups.index(group_of(name))
        scale[k] = max(scale[k], g.double().abs().max().item())
    device = next(parallelized.module.parameters()).device
    both = torch.cat([diff, scale]).to(device)
    all_reduce(both, world.group, op=ReduceOp.MAX)
    both = both.cpu()
    return Verdict(loss, ref_loss.item(),
                   {g: (both[i].item(), both[len(groups) + i].item())
                    for i, g in enumerate(groups)}, tolerance, turned_off)
