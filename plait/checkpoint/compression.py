"""Gradient compression's state in a checkpoint: each rank's error feedback and PowerSGD's Q.

Error feedback is a rank's own: what it has not yet sent. Summed over the n ranks of the reduction
it is what the mean gradient has not yet received (each buffer holds gradient / n), and that sum
is what a resumed run must keep. `compression.error.<name>` has shape (n, *the parameter's
shape): row i is rank i's, a tensor-parallel slice a box of it like the parameter's own. Resumed
on n ranks, each reads its own row back (the run continues bit for bit); on n' ranks, rank j
takes the sum of the rows i = j (mod n'), so nothing not yet sent is lost or sent twice.

PowerSGD's Q (the warm start of its power iteration) is equal on the data-parallel ranks and
belongs to a tensor-parallel layout (each slice runs its own iteration): `compression.q.<name>`
has shape (pieces, cols, r), one row per piece the layout cuts the parameter into. It is read
back where the checkpoint's layout cut the parameter alike; elsewhere Q starts afresh from its
seed, which costs the first approximations some accuracy (the error feedback keeps what they
miss), not correctness.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.checkpoint.layout import Boxes
from plait.comm.compression import sum_in_rank_order


def compression_state(par, saved: dict | None = None) -> tuple[dict, Callable[[], None]]:
    """This rank's compression state as checkpoint entries, and what to run after a load. To
    save, `saved` is None; to load, it is the checkpoint's metadata (key -> its size), by which
    the entries are fitted to what was saved."""
    engine = par.engine
    entries: dict[str, Boxes] = {}
    after: list[Callable[[], None]] = []
    if engine.compression is None:
        return entries, lambda: None
    device = next(engine.module.parameters()).device
    for buf in engine.flat_buffers():
        n, i = buf.group.size(), buf.group.rank()
        state = engine.compression.method.state_tensors(buf.key, buf.segments,
                                                        buf.full.numel(), device)
        for name, error in state.get("error", {}).items():
            place, key = par.record.params[name], f"compression.error.{name}"
            was = n if saved is None else saved.get(key, (0,))[0]
            if was == n:
                entries[key] = Boxes((n, *place.shape), [((i, *place.origin), error[None])])
                continue
            rows = {row: torch.zeros_like(error) for row in range(i, was, n)}
            if rows:
                entries[key] = Boxes((was, *place.shape), [((row, *place.origin), t[None])
                                                          for row, t in rows.items()])
                after.append(lambda error=error, rows=rows:
                             error.copy_(sum_in_rank_order(rows.values())))
        for name, q in state.get("q", {}).items():
            which, count = par.record.params[name].piece
            key, size = f"compression.q.{name}", (count, *q.shape)
            if saved is None or tuple(saved.get(key, ())) == size:
                entries[key] = Boxes(size, [((which, 0, 0), q[None])])

    def finish() -> None:
        for fn in after:
            fn()

    return entries, finish
