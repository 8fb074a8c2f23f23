"""Exact bytes of activations saved for backward: the `activation_bytes` metric.

Inside `SavedActivations(module)`, every tensor autograd saves for backward passes through a
saved-tensor hook (`torch.autograd.graph.saved_tensors_hooks`). Each is counted by its storage
(a storage saved by several operations, or through several views, counts once, whole), from the
moment it is saved until the last graph node holding it is freed, and the peak of the live total
is kept. Parameters (and views of them, such as a weight's transpose) are model state, not
activations, and are not counted; casts of them made by autocast are. Tensors that activation
checkpointing drops never reach the hook: what it keeps (block inputs) does. Not counted either:
the transient tensors of a recomputation, which live only during one block's backward.
"""

from __future__ import annotations

import torch
from torch import nn


class _Held:
    """What the hook hands autograd instead of the tensor; releases the count when freed."""

    __slots__ = ("counter", "key", "tensor")

    def __init__(self, counter: SavedActivations, key: int | None, tensor: torch.Tensor):
        self.counter, self.key, self.tensor = counter, key, tensor

    def __del__(self):
        if self.key is not None:
            self.counter._release(self.key)


class SavedActivations:
    def __init__(self, module: nn.Module):
        self._params = {id(p) for p in module.parameters()}
        self._params |= {id(p._base) for p in module.parameters() if p._base is not None}
        self._live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.bytes = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _is_param(self, t: torch.Tensor) -> bool:
        return id(t) in self._params or (t._base is not None and id(t._base) in self._params)

    @torch.compiler.disable  # a counter of what autograd keeps, never part of a compiled graph
    def _pack(self, t: torch.Tensor) -> _Held:
        # Held detached (same storage; autograd re-attaches what it needs on unpack): a saved
        # graph output held with its grad_fn makes a cycle through C++ that no collector frees
        # once a graph is kept (retain_graph=True, as a split backward keeps it): a leak of every
        # such tensor, every step (pytorch/pytorch#189025).
        if self._is_param(t) or t.device.type == "meta":
            return _Held(self, None, t)
        t = t.detach()
        storage = t.untyped_storage()
        if storage.nbytes() == 0:  # empty
            return _Held(self, None, t)
        # The storage's own identity (its StorageImpl), not its data pointer: the same for a
        # real tensor, and defined for a fake one (`plait.predict.trace` counts those).
        key = storage._cdata
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [1, storage.nbytes()]
            self.bytes += storage.nbytes()
            self.peak = max(self.peak, self.bytes)
        else:
            entry[0] += 1
        return _Held(self, key, t)

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= entry[1]
            del self._live[key]

    def __enter__(self) -> SavedActivations:
        self.peak = self.bytes
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
