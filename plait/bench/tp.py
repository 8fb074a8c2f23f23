"""`plait bench step --nproc T parallel.tp=T`: a training step under plait's tensor parallelism
against the same step under PyTorch's own DTensor tensor parallelism
(`torch.distributed.tensor.parallel.parallelize_module` with the Megatron colwise / rowwise plan,
the embedding rowwise, the head colwise into `loss_parallel`), on the same model, batch and seed.

Each side runs in processes of its own, the sides launched by turns (`bench step`'s
isolation); plait's two variants take turns within theirs. The
ratio compares plait TP with torch TP (both without sequence parallelism). With `model.hf`, plait
splits the transformers model by its plait plan, and torch by the model's own
(`base_model_tp_plan`, translated to `parallelize_module` styles).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from plait.bench.step import start_worker, step_times
from plait.config.schema import Config
from plait.data.batches import TokenData
from plait.host_memory import malloc_threshold
from plait.mesh import Axis
from plait.model import build_model
from plait.model.hf import transformers_model
from plait.parallel.tensor_parallel import apply_tp, block_splits
from plait.parallel.vocab_parallel import vocab_parallel_cross_entropy
from plait.train.trainer import build_configured_model


def torch_tp_plan(model) -> dict:
    """torch's `parallelize_module` plan splitting what plait's model plan splits."""
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i, block in model.layers.items():
        for path, dim in block_splits(model.plan, block).items():
            plan[f"layers.{i}.{path}"] = ColwiseParallel() if dim == 0 else RowwiseParallel()
    return plan


def hf_tp_plan(hf) -> dict:
    """torch's `parallelize_module` plan from a transformers model's own tensor-parallel plan
    (its config's `base_model_tp_plan`: "colwise" / "rowwise" by module pattern), the head
    column-parallel into `loss_parallel`."""
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {}
    for pattern, style in (hf.config.base_model_tp_plan or {}).items():
        if style not in styles:
            raise ValueError(f"{type(hf).__name__}'s tp plan has style {style!r}, which this "
                             "bench does not translate")
        for name, _ in hf.model.named_modules():
            if fnmatchcase(name, pattern):
                plan[f"model.{name}"] = styles[style]()
    plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


@record
def bench_tp(cfg: Config, steps: int, side: str) -> dict | None:
    """One side's step times on this world (`bench step`'s sides, each in processes of its
    own): plait's TP and TP + SP ("plait"), or torch's DTensor TP ("torch"); and the glibc
    threshold this process set."""
    _, mesh = start_worker(cfg)
    group, args, rank = mesh["tp"].get_group(), cfg.model.args(), dist.get_rank()
    x, y = TokenData(cfg.data, cfg.train.seed).batch(0, cfg.train.global_batch)

    def plait_step(sequence_parallel):
        model = build_configured_model(cfg)
        apply_tp(model, Axis.of(mesh, "tp"), sequence_parallel)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            vocab_parallel_cross_entropy(model(x), y, group, args.vocab_size).backward()
            opt.step()

        return step

    def torch_step():
        if cfg.model.hf:  # transformers' model with its own tp plan
            model = transformers_model(cfg.model.hf, cfg.train.seed)
            parallelize_module(model, mesh["tp"], hf_tp_plan(model))

            def forward(tokens):
                return model(input_ids=tokens, use_cache=False).logits
        else:
            model = forward = build_model(args, cfg.train.seed)
            parallelize_module(model, mesh["tp"], torch_tp_plan(model))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            with loss_parallel():
                F.cross_entropy(forward(x).flatten(0, 1), y.flatten()).backward()
            opt.step()

        return step

    runners = {"plait": plait_step(False), "plait_sp": plait_step(True)} if side == "plait" \
        else {"torch": torch_step()}
    times = step_times(runners, group, steps)
    dist.destroy_process_group()
    return {**times, "malloc_threshold": malloc_threshold()} if rank == 0 else None
