"""Any optimizer that needs whole matrices (`torch.optim.Muon`, `torch.optim.Adafactor`'s factored
moments, Shampoo), under any layout, through the Python API (`Prepared.optimizer`).

The user names which parameters such an optimizer steps (`plait.prepare(..., whole=...)`); the
data-parallel engine keeps them in flat buffers of their own. Each matrix has an owner
(`optim.muon.MatrixExchange`: balanced over the ranks holding its pieces), which keeps it whole
in fp32 with the user's optimizer and all of that optimizer's state for it. A step: the gradients'
pieces go to their owners (the exchange's all-to-alls, in fp32), each owner's optimizer steps its
whole matrices, and the new values come back to the ranks that hold their pieces. The rest of the
parameters (slices under ZeRO) go to the other optimizer the user gives, elementwise as always.

Memory: each owner holds its matrices whole (a share of all of them, as ZeRO's slices are a share)
plus the user's optimizer state for them; the pieces the engine holds stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.optim.muon import MatrixExchange

Factory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class WholeMatrices:
    """Two optimizers as one: `whole(matrices)` over the matrices this rank owns, whole; `rest`
    over what the engine hands out elementwise. Drive it as any optimizer: `param_groups` (both
    optimizers' groups: set lr there), `step()`, `zero_grad()`, `state`."""

    def __init__(self, exchange: MatrixExchange, held: list[torch.Tensor],
                 rest: list[torch.Tensor], whole: Factory, others: Factory):
        self.exchange, self.held = exchange, held
        owned = exchange.gather({id(t): t.detach() for t in held}, torch.float32)
        self.matrices = {name: w.clone() for name, w in owned.items()}  # this rank's, whole
        self.matrix_optimizer = whole(list(self.matrices.values())) if self.matrices else None
        self.rest = others(rest) if rest else None  # elementwise, over what the engine holds
        self.optimizers = [o for o in (self.matrix_optimizer, self.rest) if o]
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {k: v for o in self.optimizers for k, v in o.state.items()}

    def matrix_state(self) -> dict[tuple[str, str], torch.Tensor]:
        """The whole-matrix optimizer's state of each matrix this rank owns, by (matrix, key):
        what a checkpoint holds of it (`plait/checkpoint/rank_state.py`). Every matrix's state
        lies whole on its owner, so it reshards by ownership alone: a rank of another layout
        reads the matrices it owns there."""
        out, optimizer = {}, self.matrix_optimizer
        for name, w in self.matrices.items():
            for key, value in (optimizer.state.get(w, {}) if optimizer else {}).items():
                if isinstance(value, int | float):  # a step count kept as a number
                    value = torch.tensor(value)
                if not isinstance(value, torch.Tensor):
                    raise NotImplementedError(
                        f"{type(optimizer).__name__}'s state '{key}' of {name} is a "
                        f"{type(value).__name__}: checkpoints hold tensors and numbers only")
                out[name, key] = value
        return out

    def load_matrix_state(self, saved: dict[tuple[str, str], torch.Tensor]) -> None:
        """Put `saved` (`matrix_state`'s form, read from a checkpoint) into the whole-matrix
        optimizer's state, and the owned matrices again from the pieces the engine holds (a
        checkpoint has just been read into them): on every rank at once, as `step`."""
        for name, w in self.matrices.items():
            state = {key: t for (matrix, key), t in saved.items() if matrix == name}
            if state:
                self.matrix_optimizer.state[w] = state
        with torch.no_grad():
            owned = self.exchange.gather({id(t): t.detach() for t in self.held}, torch.float32)
            for name, w in owned.items():
                self.matrices[name].copy_(w)

    def grads_to_scale(self) -> list[torch.Tensor]:
        """The tensors whose gradients clipping and unscaling multiply before `step` (the pieces
        the engine holds: the whole matrices get theirs in `step`)."""
        rest = [p for g in (self.rest.param_groups if self.rest else []) for p in g["params"]]
        return self.held + rest

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)
        for t in self.held:
            t.grad = None

    @torch.no_grad()
    def step(self, closure=None) -> None:
        grads = self.exchange.gather({id(t): t.grad for t in self.held}, torch.float32)
        for name, w in self.matrices.items():
            w.grad = grads[name]
        for o in self.optimizers:
            o.step()
        values = self.exchange.scatter(self.matrices, torch.float32)
        for t in self.held:
            flat = t.view(-1)
            for piece in self.exchange.pieces.get(id(t), []):
                flat[piece.lo : piece.lo + piece.count] = values[piece.matrix.name]
