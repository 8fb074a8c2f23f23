"""The script of `single_device.py`, converted to plait: the same model, batches and losses, on
any number of processes (`--zero` picks DDP or a ZeRO stage).

    plait run --nproc 2 examples/convert/with_plait.py [--zero 1]
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import plait

STEPS, BATCH = 40, 64


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero", type=int, default=0)
    zero = parser.parse_args().zero
    plait.init()
    torch.manual_seed(0)
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16
    y = torch.tensor(data.target)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    job = plait.prepare(model, F.cross_entropy, plait.ParallelConfig(zero=zero))
    optimizer = torch.optim.AdamW(job.parameters(), lr=1e-3)
    order = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        rows = torch.randint(len(x), (BATCH,), generator=order)
        loss = job.step(*job.local(x[rows], y[rows]), optimizer, grad_clip=1.0)
        if step % 10 == 0 or step == STEPS - 1:
            plait.print0(f"step {step:3d}  loss {loss:.6f}")
    plait.finish()


if __name__ == "__main__":
    main()
