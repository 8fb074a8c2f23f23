"""What every compression method shares (the package's docstring says what a method is): the
segments of a flat buffer, the chained collectives, the method protocol and `Compression`, the
method with when it applies. The methods import this module, the package imports the methods."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from math import prod
from typing import NamedTuple, Protocol

import torch
from torch.distributed import ProcessGroup

from plait.comm.collectives import Op, Pending, all_gather


class Segment(NamedTuple):
    """One parameter's place in a flat buffer: elements [offset, offset + numel) with `shape`."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's elements of `flat`, 1-D."""
        return flat[self.offset : self.offset + self.numel]


def layout(members) -> list[Segment]:
    """Segments of (name, tensor) pairs laid out back to back from element 0."""
    out, offset = [], 0
    for name, p in members:
        out.append(Segment(name, offset, tuple(p.shape)))
        offset += p.numel()
    return out


def replica_segment(numel: int) -> Segment:
    """A ZeRO slice as one segment: what hybrid sharding compresses across its replicas (the
    stateless methods only, which read no parameter's shape)."""
    return Segment("replicas", 0, (numel,))


def members_numel(segments: list[Segment]) -> int:
    """Elements the parameters occupy (the buffer may have padding after them)."""
    return sum(s.numel for s in segments)


def sum_in_rank_order(rows: Iterable[torch.Tensor]) -> torch.Tensor:
    """rows[0] + rows[1] + ... in that order (taken one at a time, so a generator holds one row
    at once): every rank (and a one-process simulation) adds the same floats in the same order,
    so decoded results agree bit for bit."""
    rows = iter(rows)
    total = next(rows).clone()
    for row in rows:
        total += row
    return total


class Chain:
    """A first collective in flight and the work that follows it. `wait()` waits for the first,
    then runs `then` (which may decode and issue further collectives, synchronously)."""

    def __init__(self, first: Pending, then: Callable[[], None]):
        self._first, self._then = first, then

    def wait(self) -> None:
        if self._then is not None:
            self._first.wait()
            self._then()
            self._then = None


def all_gather_sum(message: torch.Tensor, group: ProcessGroup,
                   decode: Callable[[torch.Tensor], torch.Tensor],
                   write: Callable[[torch.Tensor], object]) -> Chain:
    """For messages that do not sum (sparse, bits): all-gather every rank's 1-D `message`; then
    `write` gets the sum of `decode(message)` (dense fp32) over the ranks, in rank order."""
    n = group.size()
    gathered = torch.empty(n * message.numel(), dtype=message.dtype, device=message.device)
    pending = all_gather(gathered, message, group, async_op=True)

    def then() -> None:
        write(sum_in_rank_order(decode(part) for part in gathered.view(n, -1)))

    return Chain(pending, then)


def own_chunk(out: torch.Tensor, group: ProcessGroup) -> Callable[[torch.Tensor], object]:
    """A writer for reduce-scatter: `out` <- this rank's 1/n of a full result."""
    mine = slice(group.rank() * out.numel(), (group.rank() + 1) * out.numel())
    return lambda full: out.copy_(full[mine])


class GatheredWithFeedback:
    """What top-k and sign share: messages that do not sum (sparse values, bits), with error
    feedback. Each rank adds what it held back before to its gradient, M = g + e, encodes M
    (`encode` returns the message and the dense values it carries), keeps e <- M - carried, and
    all-gathers the message; every rank decodes the n messages and adds them in rank order. What
    one step does not send is sent later. State: one fp32 error buffer per flat buffer."""

    def __init__(self):
        self.error: dict[str, torch.Tensor] = {}

    def encode(self, m: torch.Tensor, segments: list[Segment]):
        raise NotImplementedError

    def decode(self, message: torch.Tensor, numel: int, segments: list[Segment]) -> torch.Tensor:
        raise NotImplementedError

    def _reduce(self, key, flat, segments, group, write) -> Chain:
        error = self.error.setdefault(key, torch.zeros_like(flat, dtype=torch.float32))
        error += flat  # M = g + e
        message, carried = self.encode(error, segments)
        error -= carried
        numel = flat.numel()
        return all_gather_sum(message, group, lambda part: self.decode(part, numel, segments),
                              write)

    def all_reduce(self, key: str, flat: torch.Tensor, segments: list[Segment],
                   group: ProcessGroup) -> Chain:
        return self._reduce(key, flat, segments, group, flat.copy_)

    def reduce_scatter(self, key: str, flat: torch.Tensor, out: torch.Tensor,
                       segments: list[Segment], group: ProcessGroup) -> Chain:
        return self._reduce(key, flat, segments, group, own_chunk(out, group))

    def state_numel(self, segments, numel: int) -> int:
        return numel

    def state_bytes(self) -> int:
        return sum(e.numel() * e.element_size() for e in self.error.values())

    def state_tensors(self, key: str, segments: list[Segment], numel: int,
                      device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
        error = self.error.setdefault(key, torch.zeros(numel, device=device))
        return {"error": {s.name: s.of(error).view(s.shape) for s in segments}}


class Method(Protocol):
    def all_reduce(self, key: str, flat: torch.Tensor, segments: list[Segment],
                   group: ProcessGroup) -> Chain:
        """`flat` (this rank's gradient / n) becomes the compressed mean over the group."""
        ...

    def reduce_scatter(self, key: str, flat: torch.Tensor, out: torch.Tensor,
                       segments: list[Segment], group: ProcessGroup) -> Chain:
        """`out` becomes this rank's 1/n of the compressed mean; `flat` may be overwritten."""
        ...

    def messages(self, segments: list[Segment], numel: int, n: int,
                 sharded: bool) -> list[tuple[Op, int]]:
        """The collectives one buffer of `numel` elements costs on n ranks: (op, D bytes) in the
        convention of `plait.comm.collectives` (all-gather: D of the gathered output)."""
        ...

    def state_numel(self, segments: list[Segment], numel: int) -> int:
        """fp32 elements of state kept per buffer between steps."""
        ...

    def state_bytes(self) -> int:
        """Bytes of state this rank holds now."""
        ...

    def state_tensors(self, key: str, segments: list[Segment], numel: int,
                      device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
        """The state kept for buffer `key` (`numel` elements on `device`), as views that a
        checkpoint saves from and loads into: {"error": {parameter name: this rank's error
        feedback, in the parameter's shape}, "q": {name: PowerSGD's Q}}. State not made yet is
        made now as the first step would (zeros, Q's seeded start), to read a checkpoint into."""
        ...


class Compression:
    """A method and when it applies: from optimizer step `start` on (PowerSGD's authors start after
    some uncompressed steps; error feedback starts empty then), and only where the group has more
    than one rank (a group of one communicates nothing). The engine calls `step_done` once per
    optimizer step, after its last wait."""

    def __init__(self, method: Method, start: int = 0):
        self.method, self.start, self.steps = method, start, 0

    def active(self, n: int) -> bool:
        return n > 1 and self.steps >= self.start

    def step_done(self) -> None:
        self.steps += 1

    def state_bytes(self) -> int:
        return self.method.state_bytes()

    @torch.no_grad()
    def rescale(self, factor: float) -> None:
        """fp16's loss scale changed by `factor`: error feedback holds gradients as they were
        scaled, and follows it. After an overflow, an error that is not finite restarts from zero
        (what that step held back is lost) and so does PowerSGD's Q, from its seeded start. The
        methods with state keep it in `error` (and PowerSGD in `q`), by buffer or parameter."""
        for error in getattr(self.method, "error", {}).values():
            if not torch.isfinite(error).all():
                error.zero_()
            elif factor != 1.0:
                error.mul_(factor)
        q = getattr(self.method, "q", {})
        for name in [n for n, t in q.items() if not torch.isfinite(t).all()]:
            del q[name]
