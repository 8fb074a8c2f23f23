"""Expert parallelism (GShard, Lepikhin et al. 2020) over the `ep` axis, applied in place to the
mixture-of-experts layers (`plait.model.moe`) of a model or pipeline chunk.

Each of the G ranks of an ep group keeps E / G of every MoE layer's experts (rank j: experts
j E/G .. (j + 1) E/G - 1), under their single-device names. The ep ranks split the batch like
data-parallel ranks; each routes its own tokens, then, per MoE layer and micro-batch:

    counts:   an all-to-all of its kept assignments per expert (E integers): every rank learns how
              many rows it will receive from each rank for each of its experts
    dispatch: an all-to-all of the assigned tokens' rows, uneven splits, grouped by destination
    experts:  the received rows regrouped by expert (from every source), each expert run once
    return:   the reverse all-to-all brings each output row back to its token's rank, where it is
              weighted by its gate and added as on one device

and backward runs both row exchanges in reverse (`comm.autograd.AllToAll`). An expert that
receives no rows runs on none: its gradient is zero, not missing.

Routing statistics (picks, kept assignments, probability sums) are summed over the ranks that
share the batch (dp x ep), so the load-balancing loss is the global batch's: f_i counts every
rank's picks, and each rank's P_i term carries its own tokens' gradient.

ParamPlacement: an expert's parameters are sharded over ep by expert (dim None: each whole on one
coordinate) and replicated over dp, whose ranks sum their gradients; every other parameter is
replicated over ep with a partial gradient (other rows of the batch), summed over dp x ep.

Tensor parallelism splits each expert like the dense feed-forward (w1, w3 by rows, w2 by columns)
around the same collectives; the router is replicated over tp and its gradient is a partial sum
there (each rank's gates meet only its shard of the expert outputs).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from plait.comm import all_reduced, all_to_all
from plait.comm.autograd import all_to_all_rows
from plait.mesh import Axis
from plait.model.moe import MoEFeedForward, Routing, even, run_experts
from plait.model.plan import has_plan, plan_of
from plait.parallel.activation_checkpoint import recomputing
from plait.parallel.placement import PlacementRecord


def has_experts(model: nn.Module) -> bool:
    """Whether the model holds a mixture of experts its plan names (plait's MoE layers, or a
    family's stacked experts)."""
    return bool(moe_layers(model)) or (has_plan(model) and bool(plan_of(model).moe_experts))


def moe_layers(chunk: nn.Module) -> dict[str, MoEFeedForward]:
    """The chunk's mixtures of experts (its plan's `moe` module, where a block has one) by block
    index."""
    if not has_plan(chunk) or plan_of(chunk).moe is None:
        return {}
    plan, out = plan_of(chunk), {}
    for i, block in chunk.get_submodule(plan.blocks).items():
        layer = block.get_submodule(plan.moe)
        if isinstance(layer, MoEFeedForward):
            out[i] = layer
    return out


def expert_range(n_experts: int, ep: Axis) -> range:
    per = n_experts // ep.size
    return range(ep.rank * per, (ep.rank + 1) * per)


def _even_exchange(counts: list[int], held: range, G: int, device) -> tuple[torch.Tensor,
                                                                          list[int], list[int]]:
    """The counts exchange of a trace, whose tokens hold no values: every rank of the ep group
    routes as this one did (`counts` per expert, ints), so rank s sends each of this rank's
    experts what this rank sends them. (arriving (G, experts held), rows sent, rows received
    per rank)."""
    per = len(held)
    mine = counts[held.start : held.stop]
    send = [sum(counts[j * per : (j + 1) * per]) for j in range(G)]
    return torch.tensor([mine] * G, device=device), send, [sum(mine)] * G


class AllToAllDispatch:
    """`MoEFeedForward.dispatch` across the ranks of `ep`, this rank holding experts `held`."""

    def __init__(self, ep: Axis, held: range):
        self.ep, self.held = ep, held
        # Per forward: (rows sent, rows received, a backward will follow), for the accounting
        # of the token all-to-alls (`cost.all_to_all_bytes`); the trainer clears it each step.
        self.rows: list[tuple[int, int, bool]] = []

    def __call__(self, tokens: torch.Tensor, routing: Routing,
                 experts: nn.ModuleDict) -> torch.Tensor:
        group, per = self.ep.group, len(self.held)
        counts = routing.kept.view(self.ep.size, per)  # row j: for rank j's experts
        arriving = torch.empty_like(counts)  # row s: from rank s, for each of this rank's experts
        all_to_all(arriving, counts, group)
        if routing.counts is None:
            send, recv = counts.sum(1).tolist(), arriving.sum(1).tolist()
            held = arriving.sum(0).tolist()  # rows for each of this rank's experts
        else:  # fake tokens (a trace): every rank routes evenly, as this one
            arriving, send, recv = _even_exchange(routing.counts, self.held, self.ep.size,
                                                  counts.device)
            held = [self.ep.size * c for c in routing.counts[self.held.start : self.held.stop]]
        self.rows.append((sum(send), sum(recv), torch.is_grad_enabled() and not recomputing()))
        rows = all_to_all_rows(tokens[routing.token], send, recv, group)
        # Rows arrive by (source, expert); each expert runs once on all of its rows.
        local = torch.arange(per, device=rows.device).repeat(self.ep.size)
        order = torch.sort(local.repeat_interleave(arriving.flatten(), output_size=sum(recv)),
                           stable=True).indices
        out = run_experts(rows[order], held, experts, self.held.start)
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order), device=order.device)
        return all_to_all_rows(out[back], recv, send, group)


class StackedExperts(nn.Module):
    """Expert parallelism for an experts module whose weights are stacked along dim 0, one row
    per expert, and whose forward is transformers' contract: (x (T, dim), top_k_index (T, k),
    top_k_weights (T, k)) -> (T, dim), the weighted sum of each token's experts. This rank keeps
    its E / G rows of every weight, under the same names (the module's own parameters, sliced,
    registered here), and the module itself computes them:

        the assignments, sorted by expert, go to the experts' ranks (counts, then rows: the
        all-to-alls of `AllToAllDispatch`); each arriving row runs through its local expert (the
        module, as if each row had one expert of weight 1); the outputs come back, are weighted
        by their gates and summed per token."""

    def __init__(self, experts: nn.Module, ep: Axis):
        super().__init__()
        n = experts.num_experts
        self.ep, self.held = ep, expert_range(n, ep)
        for name, p in list(experts.named_parameters(recurse=False)):
            kept = nn.Parameter(p.detach()[self.held.start : self.held.stop].clone())
            setattr(experts, name, kept)
            self.register_parameter(name, kept)
        experts.num_experts = len(self.held)
        self.__dict__["local"] = experts  # the computation, not a submodule: names unchanged
        self.n_experts = n

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        group, G, per = self.ep.group, self.ep.size, len(self.held)
        k = top_k_index.shape[1]
        order = torch.sort(top_k_index.reshape(-1), stable=True).indices
        token = order // k  # each assignment's token, in expert order
        fake = isinstance(top_k_index, FakeTensor)  # a trace: every rank routes evenly
        even_counts = even(top_k_index.numel(), self.n_experts) if fake else None
        counts = torch.tensor(even_counts, device=x.device).view(G, per) if fake else \
            torch.bincount(top_k_index.reshape(-1), minlength=self.n_experts).view(G, per)
        arriving = torch.empty_like(counts)  # row s: from rank s, for each of this rank's experts
        all_to_all(arriving, counts, group)
        if fake:
            arriving, send, recv = _even_exchange(even_counts, self.held, G, x.device)
        else:
            send, recv = counts.sum(1).tolist(), arriving.sum(1).tolist()
        rows = all_to_all_rows(x[token], send, recv, group)
        local = torch.arange(per, device=x.device).repeat(G).repeat_interleave(
            arriving.flatten(), output_size=sum(recv))
        for name, p in self._parameters.items():  # the module computes with this one's
            if self.local._parameters[name] is not p:  # (materialized from `meta` since)
                self.local._parameters[name] = p
        out = self.local(rows, local[:, None], torch.ones_like(local, dtype=x.dtype)[:, None])
        back = all_to_all_rows(out, recv, send, group)
        gates = top_k_weights.reshape(-1)[order, None].to(back.dtype)
        return torch.zeros_like(x).index_add(0, token, back * gates)


def _apply_stacked(chunk: nn.Module, ep: Axis, record: PlacementRecord | None) -> None:
    """Expert parallelism on the plan's `moe_experts` modules (stacked weights)."""
    plan = plan_of(chunk)
    parent, _, leaf = plan.moe_experts.rpartition(".")
    for i, block in chunk.get_submodule(plan.blocks).items():
        owner = block.get_submodule(parent) if parent else block
        experts = getattr(owner, leaf, None)
        if experts is None:
            continue
        if experts.num_experts % ep.size:
            raise ValueError(f"ep={ep.size} must divide the {experts.num_experts} experts")
        names = [f"{plan.blocks}.{i}.{plan.moe_experts}.{n}"
                 for n, _ in experts.named_parameters(recurse=False)]
        setattr(owner, leaf, StackedExperts(experts, ep))
        for name in names if record is not None else ():
            record.shard(name, "ep", 0)


def apply_ep(chunk: nn.Module, ep: Axis, batch: Axis, record: PlacementRecord | None = None,
             grad_scale: float = 1.0) -> None:
    """Keep this rank's experts of every MoE layer and route through the all-to-all; sum routing
    statistics over `batch` (the dp x ep ranks); scale the auxiliary losses' gradients by
    `grad_scale` (a micro-batch's share of the loss, and 1 / tp: every tp rank attaches them)."""
    names = [n for n, _ in chunk.named_parameters()]
    experts = set()
    layers = moe_layers(chunk)
    if ep.size > 1 and has_plan(chunk) and plan_of(chunk).moe_experts:
        _apply_stacked(chunk, ep, record)
        layers = {}
        experts = {n for n, p in record.params.items() if "ep" in p.shards} if record else set()
    for i, layer in layers.items():
        plan = plan_of(chunk)
        if layer.n_experts % ep.size:
            raise ValueError(f"ep={ep.size} must divide moe_experts={layer.n_experts}")
        held = expert_range(layer.n_experts, ep)
        for e in range(layer.n_experts):
            prefix = f"{plan.blocks}.{i}.{plan.moe}.experts.{e}."
            if e in held:
                experts |= {n for n in names if n.startswith(prefix)}
            else:
                del layer.experts[str(e)]
        if ep.size > 1:
            layer.dispatch = AllToAllDispatch(ep, held)
        if batch.size > 1:
            layer.reduce = functools.partial(all_reduced, group=batch.group)
        layer.grad_scale = grad_scale
    if record is not None:
        held = dict(chunk.named_parameters())
        for name in names:
            if name not in held:
                record.drop(name)  # another ep rank's expert
            elif name in experts:
                if "ep" not in record.params[name].shards:  # stacked experts: sharded on dim 0
                    record.shard(name, "ep", None)
            else:
                record.replicate(name, "ep", partial_grad=True)


def expert_overrides(record: PlacementRecord) -> set[str]:
    """Under expert parallelism, the parameters whose gradients are summed over dp alone (the
    experts, sharded over ep); the others over the dp x ep ranks that split the batch."""
    if record.sizes["ep"] == 1:
        return set()
    return {n for n, p in record.params.items() if "ep" in p.shards}
