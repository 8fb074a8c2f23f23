"""A plain single-device training script: an MLP classifying scikit-learn's digits.

    python examples/convert/single_device.py

`with_plait.py` beside it is the same script converted to plait; `diff` the two.
"""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

STEPS, BATCH = 40, 64


def main():
    torch.manual_seed(0)
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16
    y = torch.tensor(data.target)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    order = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        rows = torch.randint(len(x), (BATCH,), generator=order)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss = loss.item()
        if step % 10 == 0 or step == STEPS - 1:
            print(f"step {step:3d}  loss {loss:.6f}")


if __name__ == "__main__":
    main()
