"""fp16 / bf16: the same reduction, in two bytes per element instead of four (PyTorch's
`fp16_compress_hook`, and ZeRO's `reduce_dtype`). The buffer already holds gradient / n, so the
sum cannot overflow fp16 where the mean does not. No state."""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from plait.comm.collectives import Op, all_reduce, reduce_scatter
from plait.comm.compression.base import Chain, Segment


class Cast:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()

    def all_reduce(self, key: str, flat: torch.Tensor, segments: list[Segment],
                   group: ProcessGroup) -> Chain:
        payload = flat.to(self.dtype)
        return Chain(all_reduce(payload, group, async_op=True), lambda: flat.copy_(payload))

    def reduce_scatter(self, key: str, flat: torch.Tensor, out: torch.Tensor,
                       segments: list[Segment], group: ProcessGroup) -> Chain:
        mine = torch.empty(out.shape, dtype=self.dtype, device=out.device)
        pending = reduce_scatter(mine, flat.to(self.dtype), group, async_op=True)
        return Chain(pending, lambda: out.copy_(mine))

    def messages(self, segments, numel: int, n: int, sharded: bool) -> list[tuple[Op, int]]:
        return [(Op.REDUCE_SCATTER if sharded else Op.ALL_REDUCE, numel * self.itemsize)]

    def state_numel(self, segments, numel: int) -> int:
        return 0

    def state_bytes(self) -> int:
        return 0

    def state_tensors(self, key, segments, numel: int, device) -> dict:
        return {}
