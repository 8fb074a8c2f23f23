"""Four all-reduce algorithms with one result (the element-wise sum over the group):

- `backend`: the process group's own (gloo's or NCCL's), asynchronous.
- `ring`: the bandwidth-optimal ring of Patarasuk & Yuan (2009), written over send/recv. The tensor
  is cut into n chunks; n - 1 reduce-scatter steps leave each rank with one fully reduced chunk,
  then n - 1 all-gather steps pass the reduced chunks around. Each rank sends 2 (n - 1) chunks of
  D / n bytes: 2 (n - 1) / n * D, whatever n is.
- `naive`: everything to the root, summed there, and sent back. The root sends (n - 1) * D, which
  grows with n: the bottleneck the ring removes.
- `hierarchical`: the group seen as N nodes of G ranks (`NodeGroups`): a reduce-scatter inside
  each node leaves each of its ranks with the node's sum of one 1/G slice, an all-reduce of that
  slice across the nodes (the N ranks at the same place on each node) makes it global, and an
  all-gather inside the node puts the slices together (the 2-D / hierarchical all-reduce of
  Jia et al. 2018 and NCCL's trees across nodes). Per rank: 2 (G - 1) / G * D on the node's own
  links and 2 (N - 1) / N * D / G across nodes, where a flat ring's rank at a node's edge sends
  2 (NG - 1) / NG * D across: 1/G of it, as the G ranks of a node share the slices.

Ring and naive are made of accounted sends, so the ledger shows what each really moved. They run
synchronously (each step waits for the last), so unlike `backend` they do not overlap backward.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from plait.comm.collectives import Pending, all_gather, all_reduce, recv, reduce_scatter, send


class AllReduceAlgorithm(enum.Enum):
    BACKEND = "backend"
    RING = "ring"
    NAIVE = "naive"
    HIERARCHICAL = "hierarchical"


@dataclass(frozen=True)
class NodeGroups:
    """A group seen as nodes: `local`, this rank and the others of the group on its node (G
    ranks); `across`, the ranks at this rank's place on every node (N ranks)."""

    local: ProcessGroup
    across: ProcessGroup


def _exchange(out: torch.Tensor, to_right: torch.Tensor, right: int, left: int, group) -> None:
    """Send `to_right` to the right neighbour while receiving `out` from the left one."""
    pending = [send(to_right, right, group, async_op=True), recv(out, left, group, async_op=True)]
    for p in pending:
        p.wait()


def ring_all_reduce(flat: torch.Tensor, group: ProcessGroup) -> None:
    """In place. `flat` is 1-D; it is padded to a multiple of n elements for the exchange."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    padded = flat if flat.numel() % n == 0 else torch.cat(
        [flat, flat.new_zeros(n - flat.numel() % n)])
    chunks = padded.view(n, -1)  # chunk i: (D / n,)
    incoming = torch.empty_like(chunks[0])
    # Reduce-scatter: at step s, pass on chunk (rank - s) and add the left's chunk (rank - s - 1).
    # After n - 1 steps, chunk (rank + 1) holds the sum over all ranks.
    for s in range(n - 1):
        _exchange(incoming, chunks[(rank - s) % n], right, left, group)
        chunks[(rank - s - 1) % n] += incoming
    # All-gather: pass the reduced chunks around the ring, overwriting.
    for s in range(n - 1):
        _exchange(chunks[(rank - s) % n], chunks[(rank + 1 - s) % n], right, left, group)
    if padded is not flat:
        flat.copy_(padded[: flat.numel()])


def naive_all_reduce(flat: torch.Tensor, group: ProcessGroup) -> None:
    """In place: the root (rank 0 of `group`) receives every tensor, sums in rank order, and sends
    the sum back to each rank."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return
    if rank == 0:
        incoming = torch.empty_like(flat)
        for src in range(1, n):
            recv(incoming, src, group)
            flat += incoming
        for dst in range(1, n):
            send(flat, dst, group)
    else:
        send(flat, 0, group)
        recv(flat, 0, group)


def hierarchical_all_reduce(flat: torch.Tensor, nodes: NodeGroups) -> None:
    """In place. `flat` is 1-D; it is padded to a multiple of G elements for the slices."""
    G = dist.get_world_size(nodes.local)
    padded = flat if flat.numel() % G == 0 else torch.cat(
        [flat, flat.new_zeros(G - flat.numel() % G)])
    mine = torch.empty(padded.numel() // G, dtype=flat.dtype, device=flat.device)  # (D / G,)
    reduce_scatter(mine, padded, nodes.local)  # the node's sum of slice `local`
    all_reduce(mine, nodes.across)  # every node's: the group's sum of the slice
    all_gather(padded, mine, nodes.local)
    if padded is not flat:
        flat.copy_(padded[: flat.numel()])


def all_reduce_by(
    algorithm: AllReduceAlgorithm, flat: torch.Tensor, group: ProcessGroup,
    nodes: NodeGroups | None = None,
) -> Pending:
    """Sum `flat` over `group` in place with `algorithm` (hierarchical: over `group`'s `nodes`);
    wait on the result before reading it."""
    if algorithm is AllReduceAlgorithm.BACKEND:
        return all_reduce(flat, group, async_op=True)
    if algorithm is AllReduceAlgorithm.HIERARCHICAL:
        if nodes is None:
            raise ValueError("the hierarchical all-reduce needs the group's NodeGroups")
        hierarchical_all_reduce(flat, nodes)
        return Pending(None)
    (ring_all_reduce if algorithm is AllReduceAlgorithm.RING else naive_all_reduce)(flat, group)
    return Pending(None)
