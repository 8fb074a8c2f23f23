"""Reused buffers for ZeRO-3's gathered units and gradient staging.

ZeRO-3 gathers a unit, uses it, frees it, and does so for every unit twice a step; each unit's
gradient staging is made and let go as often. On a CPU every fresh buffer is memory from glibc's
malloc: either fresh pages from the kernel (above the mmap threshold: zeroed and faulted in at
every gather, 1.6 times fully_shard's step on the default recipe, measured), or heap that the
blocks freed in between leave resident (below it: a rank's peak grew by 2.3 times the whole fp32
model over three steps, `plait/host_memory.py`). So the buffers are made once and handed
from unit to unit.

A tensor's storage stays the same object while its memory comes and goes (`attach`, `detach`):
the parameters are views of the unit's flat buffer, and autograd saved views of them (a weight's
transpose) between a unit's forward and its backward, so the memory must change under those views
rather than the views change. `UntypedStorage._swap_data_ptr_` exchanges the memory (pointer and
size) of two storages: an empty storage and a pooled buffer trade places.

The pool keeps no more buffers than were attached at once (its high-water mark), each the size
of one request or larger (the smallest idle one that fits is taken; when none fits, a new one is
made and the largest idle one, too small, is let go). Under `reshard_after_forward` that is the
units in flight at once (the running one and the prefetched one) and the two staging buffers
(one reducing while the next fills); a pipeline's units held across micro-batches keep that many.
The engines let the idle ones go once the backward is over (`release_idle`): the optimizer's step
needs the memory more (AdamW's update makes a copy of the slices), and the next forward makes
those few again, where the step used to make two per unit. Buffers under `SMALLEST` bytes (norm
gains, biases) are left to the allocator: too small for a fresh page to cost, and pooled they
would each hold a large buffer.

Only host memory is pooled. A GPU's memory already comes from torch's caching allocator, which
reuses freed blocks without the kernel or the heap in between; the pool leaves it to that
(`attach` is a plain resize there), as it does on a torch without `_swap_data_ptr_` (2.11 has none).
"""

from __future__ import annotations

import torch

SMALLEST = 1 << 20  # bytes: smaller buffers are allocated and freed as usual
SWAPS = hasattr(torch.UntypedStorage, "_swap_data_ptr_")  # 2.13 has it, 2.11 not


class BufferPool:
    """Buffers handed to storages that need memory for a while (`attach`) and taken back when
    they are done (`detach`)."""

    def __init__(self):
        self._idle: list[torch.UntypedStorage] = []  # by size, smallest first
        self._attached: set[int] = set()  # the identities of the storages holding one
        self._most = 0  # the most buffers attached at once

    def attach(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give `storage` (empty) `nbytes` bytes or more, reused where one is idle. Its contents
        are whatever its last user left."""
        # meta: a fake tensor's (predict.trace); cuda and the rest: their own caching allocator.
        if nbytes < SMALLEST or storage.device.type != "cpu" or not SWAPS:
            storage.resize_(nbytes)
            return
        fit = next((i for i, b in enumerate(self._idle) if b.nbytes() >= nbytes), None)
        if fit is None:
            if self._idle:
                self._idle.pop()  # the largest idle buffer, too small: let go
            buffer = torch.UntypedStorage(nbytes, device=storage.device)
        else:
            buffer = self._idle.pop(fit)
        storage._swap_data_ptr_(buffer)  # `buffer` is the empty one now
        self._attached.add(storage._cdata)
        self._most = max(self._most, len(self._attached))

    def detach(self, storage: torch.UntypedStorage) -> None:
        """Take `storage`'s memory back: the storage is empty after (what still views it reads
        nothing until the next `attach`)."""
        if storage._cdata not in self._attached:
            storage.resize_(0)  # small, or allocated before the pool (a model built whole)
            return
        self._attached.remove(storage._cdata)
        buffer = torch.UntypedStorage(0, device=storage.device)
        storage._swap_data_ptr_(buffer)
        if len(self._idle) + len(self._attached) < self._most:
            self._idle.append(buffer)
            self._idle.sort(key=torch.UntypedStorage.nbytes)

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed 1-D tensor whose memory is `attach`ed (`detach` its storage when done)."""
        tensor = torch.empty(0, dtype=dtype, device=device)
        storage = tensor.untyped_storage()
        if storage.device.type == "meta":  # under FakeTensorMode (predict.trace): no memory
            return tensor.new_zeros(numel)
        self.attach(storage, numel * dtype.itemsize)
        return tensor.set_(storage, 0, (numel,)).zero_()

    def release_idle(self) -> None:
        """Let the idle buffers go (the next `attach`es make new ones)."""
        self._idle.clear()

    @property
    def idle_bytes(self) -> int:
        """Bytes held in idle buffers."""
        return sum(b.nbytes() for b in self._idle)
