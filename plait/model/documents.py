"""Document masking ("packed sequences"): a training window may hold the end of one document and
the start of the next; with `data.document_mask` attention stops at the boundary, so that each
document's tokens attend only to earlier tokens of the same document (block-diagonal causal
attention) and their rotary positions restart at each document's first token in the window. A
window's tokens then get the logits each document would get alone.

A `Documents` is one micro-batch's boundaries: which document of its window each token belongs
to, for the whole window (every cp rank keeps all of it: a few ids per token), and which tokens
this rank holds (context parallelism's shard; all of them without it). The attention kernels ask
it for the mask between any query and key positions of the window (`mask`), which is how the ring
masks a block that came from another rank and Ulysses the whole sequence it gathers; the models
ask it for their tokens' positions (`positions`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Documents:
    ids: torch.Tensor  # (rows, window): each token's document, numbered from the window's start
    index: torch.Tensor  # (tokens,): the positions in the window of the tokens this rank holds
    # The additive masks made so far (`additive`), one per kind and dtype: every layer of a
    # forward gets the same tensor, which attention then saves for backward once, not per layer.
    _made: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def whole(ids: torch.Tensor) -> Documents:
        """The boundaries of whole windows (one process, no context parallelism)."""
        return Documents(ids, torch.arange(ids.shape[1], device=ids.device))

    def shard(self, index: torch.Tensor) -> Documents:
        """The same windows as seen by a rank that holds the tokens at `index`."""
        return Documents(self.ids, index.to(self.ids.device))

    def rows(self, parts: int) -> list[Documents]:
        """Cut into `parts` equal runs of rows (micro-batches)."""
        return [Documents(ids, self.index) for ids in self.ids.chunk(parts)]

    def to(self, device: torch.device) -> Documents:
        return Documents(self.ids.to(device), self.index.to(device))

    def positions(self) -> torch.Tensor:
        """(rows, tokens): each held token's position within its document, counted from the
        document's first token in the window (0 for the window's first token)."""
        ids = self.ids
        at = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        new = torch.ones_like(ids, dtype=torch.bool)
        new[:, 1:] = ids[:, 1:] != ids[:, :-1]
        first = torch.where(new, at, 0).cummax(dim=1).values  # where each token's document began
        return (at - first)[:, self.index]

    def mask(self, queries: torch.Tensor | None = None,
             keys: torch.Tensor | None = None) -> torch.Tensor:
        """(rows, 1, queries, keys) bool, True where the query at window position `queries[i]`
        may see the key at `keys[j]`: the key is no later and of the same document. Both default
        to the tokens this rank holds."""
        q = self.index if queries is None else queries
        k = self.index if keys is None else keys
        same = self.ids[:, q, None] == self.ids[:, None, k]
        return (same & (k[None, :] <= q[:, None])).unsqueeze(1)

    def whole_mask(self) -> torch.Tensor:
        """`mask` over the whole window (Ulysses: each rank attends over all of it)."""
        every = torch.arange(self.ids.shape[1], device=self.ids.device)
        return self.mask(every, every)

    def additive(self, dtype: torch.dtype, whole: bool = False) -> torch.Tensor:
        """`mask()` (or `whole_mask()`) as attention kernels take it: 0 where a query sees a key,
        -inf elsewhere, in `dtype` (the queries'); made once per Documents, kind and dtype."""
        key = (whole, dtype)
        if key not in self._made:
            seen = self.whole_mask() if whole else self.mask()
            self._made[key] = torch.zeros(seen.shape, dtype=dtype, device=seen.device) \
                .masked_fill(~seen, -math.inf)
        return self._made[key]

