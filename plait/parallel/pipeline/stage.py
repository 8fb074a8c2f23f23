"""Cutting a `plait.model.Transformer` into pipeline chunks.

Chunk c of C holds a contiguous run of layers; the first also the embedding, the last also the
final norm and the output head (the loss is computed there). Layers are balanced by parameter
count (the embedding and head counting toward their chunks) unless a split is given. A chunk keeps
the model's parameter names (`layers.4.attention.wq.weight`), so weights, checkpoints and the
single-device reference line up.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.model.llama import Transformer, rope_tables


def balanced_split(costs: list[int], first_extra: int, last_extra: int, parts: int) -> list[int]:
    """Layers per part: a contiguous partition of `costs` into `parts` non-empty runs minimising
    the heaviest part, the first part carrying `first_extra` more and the last `last_extra`."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: lowest possible max cost of cutting the first i layers into k parts.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = prefix[i] - prefix[j] + (first_extra if k == 1 else 0)
                cost += last_extra if k == parts and i == n else 0
                value = max(best[k - 1][j], cost)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


class PipelineChunk(nn.Module):
    """Layers [start, end) of the model, with the embedding if first and the head if last.
    forward: tokens (b, s) or hidden (b, s, dim) -> hidden (b, s, dim), or logits if last."""

    def __init__(self, model: Transformer, start: int, end: int, first: bool, last: bool):
        super().__init__()
        self.args = model.args
        if first:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in range(start, end)})
        if last:
            self.norm, self.output = model.norm, model.output
        self.first, self.last = first, last
        # Under sequence parallelism hidden states between chunks hold 1/T of the sequence (set
        # by apply_tp); rotary positions span the whole sequence (of this cp rank's shard).
        self.seq_shards = 1
        self.positions = model.positions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1] if self.first else x.shape[1] * self.seq_shards
        h = self.tok_embeddings(x) if self.first else x
        positions = self.positions(seq, h.device)
        cos, sin = rope_tables(positions, self.args.head_dim, self.args.rope_theta)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h)) if self.last else h


class StageModules(nn.ModuleDict):
    """This pipeline stage's chunks, keyed by global chunk index, in execution order. Parameters
    are named as in the single-device model (`layers.4.attention.wq.weight`): the chunk index is
    not part of a name, so every consumer (engines, placement record, checkpoints, tests) sees the
    same names whatever the split."""

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        for chunk in self.values():
            yield from chunk.named_parameters(prefix, recurse, remove_duplicate)


def chunk_sizes(model: Transformer, chunks: int) -> list[int]:
    """Layers per chunk, balanced by parameter count."""
    per_layer = [sum(p.numel() for p in block.parameters()) for block in model.layers.values()]
    head = sum(p.numel() for p in (*model.norm.parameters(), *model.output.parameters()))
    return balanced_split(per_layer, model.tok_embeddings.weight.numel(), head, chunks)


def split_model(model: Transformer, chunks: int, sizes: list[int] | None = None):
    """All C chunks of `model` (sharing its modules), balanced unless `sizes` lists the layers
    per chunk."""
    args = model.args
    if sizes is None:
        sizes = chunk_sizes(model, chunks)
    if len(sizes) != chunks or sum(sizes) != args.n_layers or min(sizes) < 1:
        raise ValueError(f"split {sizes} must give {chunks} chunks >= 1 layer, "
                         f"{args.n_layers} layers in all")
    out, start = [], 0
    for c, size in enumerate(sizes):
        out.append(PipelineChunk(model, start, start + size, c == 0, c == chunks - 1))
        start += size
    return out
