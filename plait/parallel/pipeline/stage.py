"""Cutting a model into pipeline chunks, as its plan says.

Chunk c of C holds a contiguous run of blocks; the first also what comes before them (the
embedding), the last what comes after (the final norm and the output head; the loss is computed
there). Blocks are balanced by parameter count (the first and last modules counting toward
their chunks) unless a split is given. A chunk keeps the model's parameter names
(`layers.4.attention.wq.weight`), so weights, checkpoints and the single-device reference line
up.
"""

from __future__ import annotations

import functools

from torch import nn

from plait.model.documents import Documents
from plait.model.plan import plan_of


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
    """Blocks [start, end) of the model, with the plan's `first` modules if first and `last` if
    last. forward: inputs or hidden (b, s, dim) -> hidden (b, s, dim), or outputs if last,
    running the model's own pieces (`embed`, `block_args`, `head`) on the modules it holds,
    which it keeps under the model's names."""

    def __init__(self, model: nn.Module, start: int, end: int, first: bool, last: bool):
        super().__init__()
        plan = plan_of(model)
        self.args, self.plan, self.code = model.args, plan, type(model)
        for name in plan.first if first else ():
            setattr(self, name, getattr(model, name))
        blocks = model.get_submodule(plan.blocks)
        setattr(self, plan.blocks, nn.ModuleDict({str(i): blocks[str(i)]
                                                  for i in range(start, end)}))
        for name in plan.last if last else ():
            setattr(self, name, getattr(model, name))
        for name in plan.shared:
            setattr(self, name, getattr(model, name))
        self.first, self.last = first, last
        # Under sequence parallelism hidden states between chunks hold 1/T of the sequence (set
        # by apply_tp); positions span the whole sequence (of this cp rank's shard).
        self.seq_shards = 1

    def forward(self, *args, documents: Documents | None = None, head_loss=None, **kwargs):
        """Tokens (first chunk) or hidden states, and the micro-batch's `documents` under
        `data.document_mask`; or, with one chunk, a batch as the model takes it. The last chunk
        returns the logits, or given `head_loss(hidden, head)` (a loss fused with the output
        head, `HeadCrossEntropy.fused`) the loss from the head's input and the plan's head."""
        if len(args) != 1 or kwargs:  # a batch as the model takes it: the model's own forward
            if not (self.first and self.last):
                raise ValueError("a pipeline chunk takes hidden states alone; a batch with more "
                                 "than the tokens runs with pp = 1")
            return self.code.forward(self, *args, **kwargs)
        x = args[0]
        seq = x.shape[1] if self.first else x.shape[1] * self.seq_shards
        h = self.code.embed(self, x) if self.first else x
        # Positional (a tuple) or by keyword; the documents only where given (a model of the
        # user's takes (h, seq_len)).
        extra = self.code.block_args(self, h, seq) if documents is None else \
            self.code.block_args(self, h, seq, documents)
        args, kwargs = (extra, {}) if isinstance(extra, tuple) else ((), extra)
        for block in self.get_submodule(self.plan.blocks).values():
            h = block(h, *args, **kwargs)
        if not self.last:
            return h
        if head_loss is None:
            return self.code.head(self, h)
        # The head called as a module (its hooks run: tp's input collective, ZeRO-3's gather and
        # release), its forward the fused loss for this call.
        head = self.get_submodule(self.plan.vocab_head)
        head.forward = functools.partial(head_loss, head=head)
        try:
            return head(self.code.head_input(self, h))
        finally:
            del head.forward


class StageModules(nn.ModuleDict):
    """This pipeline stage's chunks, keyed by global chunk index, in execution order. Parameters
    are named as in the single-device model (`layers.4.attention.wq.weight`): the chunk index is
    not part of a name, so every consumer (engines, placement record, checkpoints, tests) sees the
    same names whatever the split."""

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        for chunk in self.values():
            yield from chunk.named_parameters(prefix, recurse, remove_duplicate)


def _numel(model: nn.Module, names) -> int:
    return sum(p.numel() for n in names for p in getattr(model, n).parameters())


def chunk_sizes(model: nn.Module, chunks: int) -> list[int]:
    """Blocks per chunk, balanced by parameter count."""
    plan = plan_of(model)
    per_block = [sum(p.numel() for p in block.parameters())
                 for block in model.get_submodule(plan.blocks).values()]
    return balanced_split(per_block, _numel(model, plan.first), _numel(model, plan.last), chunks)


def split_model(model: nn.Module, chunks: int, sizes: list[int] | None = None):
    """All C chunks of `model` (sharing its modules), balanced unless `sizes` lists the blocks
    per chunk."""
    blocks = len(model.get_submodule(plan_of(model).blocks))
    if sizes is None:
        sizes = chunk_sizes(model, chunks)
    if len(sizes) != chunks or sum(sizes) != blocks or min(sizes) < 1:
        raise ValueError(f"split {sizes} must give {chunks} chunks >= 1 layer, "
                         f"{blocks} layers in all")
    out, start = [], 0
    for c, size in enumerate(sizes):
        out.append(PipelineChunk(model, start, start + size, c == 0, c == chunks - 1))
        start += size
    return out
