"""Fused projections held apart: a family whose linear computes several projections side by side
(Phi3's `qkv_proj`: q, k and v rows in one weight; its `gate_up_proj`) gets one linear per part
(`FusedLinear`), so that tensor parallelism splits each part by its own rows and a rank's output
is its q, k and v side by side, which the family's forward cuts as it cuts the whole. The parts
are `parts.0`, `parts.1`, ... under the fused module's name; `join_parts` puts them back into
the one tensor transformers' state dict holds, `part_of` finds a part in it."""

from __future__ import annotations

import re

import torch
from torch import nn


class FusedLinear(nn.Module):
    """`linear`'s output rows as parts of `sizes` rows, each a linear of its own. forward: the
    parts' outputs concatenated, as the fused linear's."""

    def __init__(self, linear: nn.Linear, sizes: list[int]):
        super().__init__()
        if sum(sizes) != linear.out_features:
            raise ValueError(f"parts of {sizes} rows do not make {linear.out_features}")
        self.parts = nn.ModuleList()
        start = 0
        for rows in sizes:
            part = nn.Linear(linear.in_features, rows, bias=linear.bias is not None,
                             device=linear.weight.device, dtype=linear.weight.dtype)
            part.weight = nn.Parameter(linear.weight.detach()[start:start + rows].clone(),
                                       requires_grad=linear.weight.requires_grad)
            if linear.bias is not None:
                part.bias = nn.Parameter(linear.bias.detach()[start:start + rows].clone(),
                                         requires_grad=linear.bias.requires_grad)
            self.parts.append(part)
            start += rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def fuse_apart(block: nn.Module, path: str, counts: list[int]) -> None:
    """Replace the linear at `path` in `block` by a `FusedLinear` of parts in proportion to
    `counts` (the config's head counts or hidden sizes of each projection)."""
    parent_path, _, leaf = path.rpartition(".")
    parent = block.get_submodule(parent_path)
    linear = getattr(parent, leaf)
    rows = linear.out_features // sum(counts)
    setattr(parent, leaf, FusedLinear(linear, [rows * c for c in counts]))


def as_linear(block: nn.Module, path: str) -> None:
    """Replace transformers' `Conv1D` at `path` in `block` (x W + b, W stored (in, out)) by the
    `nn.Linear` that computes the same (its weight W transposed)."""
    parent_path, _, leaf = path.rpartition(".")
    parent = block.get_submodule(parent_path)
    conv = getattr(parent, leaf)
    inputs, outputs = conv.weight.shape
    linear = nn.Linear(inputs, outputs, bias=conv.bias is not None, device=conv.weight.device,
                       dtype=conv.weight.dtype)
    linear.weight = nn.Parameter(conv.weight.detach().t().contiguous())
    if conv.bias is not None:
        linear.bias = nn.Parameter(conv.bias.detach().clone())
    setattr(parent, leaf, linear)


_PART = re.compile(r"^(.*)\.parts\.(\d+)\.(weight|bias)$")


def join_parts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors by name with each `FusedLinear`'s parts concatenated back into the fused
    linear's weight (and bias), in part order."""
    out, parts = {}, {}
    for name, t in tensors.items():
        m = _PART.match(name)
        if m:
            parts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = t
        else:
            out[name] = t
    for name, pieces in parts.items():
        out[name] = torch.cat([pieces[i] for i in sorted(pieces)], dim=0)
    return out


def part_of(name: str, whole: dict[str, torch.Tensor], counts: list[int]) -> torch.Tensor | None:
    """The rows of part `name` (`...parts.N.weight`) in `whole[...weight]`, the fused tensor
    (named as plait names it), cut in proportion to `counts`; None for a name of no part."""
    m = _PART.match(name)
    if m is None:
        return None
    fused = whole[f"{m.group(1)}.{m.group(3)}"]
    rows = fused.shape[0] // sum(counts)
    i = int(m.group(2))
    start = rows * sum(counts[:i])
    return fused[start:start + rows * counts[i]]
