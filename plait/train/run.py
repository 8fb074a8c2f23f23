"""One worker's whole job: process group, mesh, trainer, summary. Started by plait's launcher or by
torchrun; either way the usual environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) describes the world.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from plait.config import Config, validate
from plait.mesh import build_mesh
from plait.train.progress import print_summary
from plait.train.trainer import Summary, Trainer


def worker_device(choice: str = "auto") -> torch.device:
    """`train.device`: "cpu", "cuda" (this worker's GPU, cuda:LOCAL_RANK), or "auto" (cuda when
    there is one). A CPU run on a machine with a GPU stays on the CPU when asked to."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


@record
def run_training(cfg: Config, metrics_path: str | None = None) -> Summary:
    """Train on the world the environment describes; rank 0 shows progress and the summary."""
    torch.set_num_threads(cfg.train.threads)
    device = worker_device(cfg.train.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        dims = validate(cfg, dist.get_world_size())
        trainer = Trainer(cfg, dims, build_mesh(dims, device.type), device)
        summary = trainer.fit(metrics_path, show_progress=True)
        if dist.get_rank() == 0:
            print_summary(summary, dist.get_world_size())
        return summary
    finally:
        dist.destroy_process_group()
