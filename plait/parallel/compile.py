"""Compiled blocks (`train.compile`): each transformer block's forward through `torch.compile`,
as torchtitan compiles per block, on every layout.

Why per block, and why the forward only. A block is the unit every transform already cuts at:
ZeRO-3 gathers and frees around it, activation checkpointing keeps its input, a pipeline stage is
a run of them. Those transforms act through the module's hooks (`Module.__call__`), which stay
eager, outside the compiled region; what is compiled is `block.forward`, the block's own
arithmetic, where inductor fuses the elementwise work (norms, rotary embedding, SwiGLU, residual
adds) that is half of an eager step's time on a GPU. What inside a block cannot be traced --
tensor parallelism's collectives (autograd functions that call `plait.comm`), ring attention's
sends, routing that reads token counts -- is a graph break: dynamo compiles the pieces on either
side and runs that part eagerly. The run says how many breaks there were, once, and never fails
for them (`torch._dynamo.config.suppress_errors`: a block that cannot be compiled at all runs
eager).

Compiled once per distinct block, not per layer: dynamo treats a module's parameters and buffers
as inputs (`inline_inbuilt_nn_modules`, torch's default since 2.5), so every layer of one class
and shape reuses the first layer's graph (tests/dist/test_compile.py counts them).
"""

from __future__ import annotations

import os

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from plait.model.plan import has_plan, plan_of
from plait.parallel.activation_checkpoint import is_checkpointed
from plait.parallel.wrap import WrapPolicy, policy_of, wrapped_modules


def compile_enabled(setting: bool | str, device: torch.device) -> bool:
    """`train.compile`: true, false, or "auto": on for CUDA, off on the CPU (where compiling a
    block costs 5-50 s per process and the fused kernels save little on a small model)."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def blocks(chunk: nn.Module, policy: WrapPolicy | None = None) -> list[nn.Module]:
    """The modules compiled one by one: the plan's blocks, or, for a model with no plan, the
    modules the wrap policy names, by default the model's own units (a transformers family's
    decoder layers, as ZeRO-3's units)."""
    if has_plan(chunk):
        return list(chunk.get_submodule(plan_of(chunk).blocks).values())
    return wrapped_modules(chunk, policy or policy_of(chunk))


def apply_compile(chunks: nn.ModuleDict, backend: str = "inductor",
                  policy: WrapPolicy | None = None, required: bool = True,
                  loss_fn: object = None) -> int:
    """Compile the forward of every block of every chunk in place; returns how many. Names,
    parameters and hooks are unchanged. A model with no block to compile is refused where
    compiling was asked for (`required`), and otherwise runs eager. A loss that can compile its
    own arithmetic (`HeadCrossEntropy`: the cross-entropy fused with the output head, which runs
    outside the blocks) is compiled too."""

    # A block dynamo or the backend fails on runs eager (with torch's warning), not the run.
    torch._dynamo.config.suppress_errors = True
    _cache_per_capability()
    count = 0
    for chunk in chunks.values():
        for block in blocks(chunk, policy):
            _recomputed_eager(block)
            block.forward = torch.compile(block.forward, backend=backend, dynamic=False)
            count += 1
    if hasattr(loss_fn, "compile"):
        loss_fn.compile(backend)
    if count == 0 and required:
        raise ValueError("train.compile: no block to compile (the model has no plan naming its "
                         "blocks, and the wrap policy chose no module); set train.compile=false")
    return count


def _cache_per_capability() -> None:
    """Inductor's compiled kernels are cached on disk (`TORCHINDUCTOR_CACHE_DIR`, else one folder
    per user) under a key that leaves out the vector ISA inductor picks from
    `ATEN_CPU_CAPABILITY`: on an AVX-512 CPU, a block compiled once natively and then under
    `ATEN_CPU_CAPABILITY=avx2` (how the suite's tolerances are checked against AVX2 kernels)
    loaded the first run's artifacts and computed garbage (NaN, or off by 1e2; measured with
    torch 2.13). Where the capability is forced and the cache folder is torch's default, each
    capability gets a folder of its own."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    default = os.path.abspath(default_cache_dir())
    chosen = os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR", default))
    if capability and chosen == default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}_{capability}"


def _recomputed_eager(block: nn.Module) -> None:
    """A module recomputed in the backward inside a compiled block (selective recomputation)
    runs eager, its checkpoint's hooks too: traced into the block's graph, its forward would save
    what the graph chooses while the recomputation, eager, makes what eager makes, and
    torch.utils.checkpoint refuses the mismatch. The block is compiled in the pieces between."""
    for module in block.modules():
        if module is not block and is_checkpointed(module):
            module.forward = torch.compiler.disable(module.forward)


def graph_breaks() -> tuple[int, str | None]:
    """(graph breaks dynamo has taken in this process, the first one's reason)."""

    breaks = counters["graph_break"]
    return sum(breaks.values()), next(iter(breaks), None)


def compiled_graphs() -> int:
    """Distinct graphs dynamo has compiled in this process."""

    return counters["stats"]["unique_graphs"]
