"""Data parallelism, the simple version: replicas start equal, and after the last backward of a
step one all-reduce of all gradients, flattened into one buffer, averages them.

It overlaps nothing and buckets nothing; it is the reference the bucketed engine is tested against.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from plait.comm import all_reduce, broadcast


class NaiveDataParallel(nn.Module):
    """Wraps a module whose replicas live on the ranks of `group` (the `dp` axis)."""

    def __init__(self, module: nn.Module, group: ProcessGroup):
        super().__init__()
        self.module, self.group = module, group
        self.size = torch.distributed.get_world_size(group)
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                broadcast(t.data, src=0, group=group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """Average the gradients over the group; call once after the step's last backward."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        missing = [
            n for n, p in self.module.named_parameters() if p.requires_grad and p.grad is None
        ]
        if missing:
            raise RuntimeError(f"parameters got no gradient this step: {', '.join(missing)}")
        if self.size == 1:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        all_reduce(flat, self.group)
        flat /= self.size
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()
