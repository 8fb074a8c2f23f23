"""A convolutional classifier with BatchNorm, trained with ZeRO-3 on scikit-learn's digits (8 x 8
images of handwritten digits, shipped inside scikit-learn: nothing is downloaded).

    plait run --nproc 2 examples/digits_zero3.py [--steps 60] [--zero 3]

Each ConvBlock is a ZeRO-3 unit (`wrap`): its parameters are gathered just before it runs and
freed after; the stem-less rest (the classifier head) is one more unit. BatchNorm's running
statistics are broadcast from rank 0 before each step, as torch DDP does.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import plait


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


class DigitsNet(nn.Module):
    """(b, 1, 8, 8) images -> (b, 10) logits."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.blocks = nn.Sequential(ConvBlock(1, width), ConvBlock(width, 2 * width),
                                    nn.MaxPool2d(2), ConvBlock(2 * width, 2 * width))
        self.head = nn.Linear(2 * width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(dim=(2, 3)))


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train images, train labels, test images, test labels): the last 297 images are the test
    set."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    return x[:1500], y[:1500], x[1500:], y[1500:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--zero", type=int, default=3)
    args = parser.parse_args()

    device = plait.init()
    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = digits()
    job = plait.prepare(DigitsNet(), F.cross_entropy, plait.ParallelConfig(zero=args.zero),
                        wrap=plait.WrapPolicy(classes=(ConvBlock,)), device=device)
    optimizer = torch.optim.AdamW(job.parameters(), lr=3e-3)
    order = torch.Generator().manual_seed(0)  # the same global batches on every rank
    for step in range(args.steps):
        rows = torch.randint(len(x_train), (args.batch,), generator=order)
        inputs, targets = job.local(x_train[rows].to(device), y_train[rows].to(device))
        loss = job.step(inputs, targets, optimizer, grad_clip=1.0)
        if step % 20 == 0 or step == args.steps - 1:
            plait.print0(f"step {step:3d}  loss {loss:.4f}")
    job.model.eval()
    with torch.no_grad():  # each rank scores its share of the test set
        keep = len(x_test) - len(x_test) % job.rows
        inputs, targets = job.local(x_test[:keep].to(device), y_test[:keep].to(device))
        correct = (job.model(inputs).argmax(-1) == targets).float().mean().item()
    plait.print0(f"test accuracy {job.global_mean(correct):.3f} on {keep} images")
    plait.finish()


if __name__ == "__main__":
    main()
