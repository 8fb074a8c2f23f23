"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training",
sec. 3.2): the loss is multiplied by a scale S before backward so that small gradients stay
representable in fp16 (whose smallest normal is 2^-14), and gradients are divided by S before
the optimizer sees them. A step whose gradients overflowed (an infinite or NaN element anywhere)
is skipped, and S backs off.

The rule is `torch.amp.GradScaler`'s, plus Megatron's and DeepSpeed's hysteresis:

- an overflow: the step is skipped, the growth count restarts, and after `hysteresis` overflows
  since the last growth S is halved (hysteresis 1: at every overflow, GradScaler's rule); a scale
  that would fall below `min_scale` stops the run, naming `train.loss_scale_min`;
- a clean step: the growth count rises; after `growth_interval` clean steps in a row S doubles
  (and the hysteresis allowance is restored).

A static scale (`train.loss_scale` a number) never changes; overflowing steps are still skipped.
A skipped step leaves the parameters, the optimizer's state (AdamW's step count too) and the
learning-rate schedule where they were: DeepSpeed's rule (its engine does not advance the LR
scheduler on an overflow); the data moves on (a step's batch is a function of the step).

One decision for the whole job, without a collective of its own: an overflow shows in the global
gradient norm (`Parallelized.grad_norm_sq`), which is already reduced over every axis whose ranks
hold different gradients, and data-parallel replicas sum their gradients before it: every rank
sees the same norm, so every rank skips alike and keeps the same S.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The half-precision dtypes by `train.precision`; fp32 has none.
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaleTooSmall(RuntimeError):
    """The dynamic loss scale fell below `train.loss_scale_min`."""


@dataclass
class LossScaler:
    """The scale and its counters; the same on every rank (see the module's docstring)."""

    scale: float = 2.0**16
    dynamic: bool = True
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    growth_tracker: int = 0  # clean steps since the last overflow or growth
    hysteresis_left: int = 0  # overflows still tolerated before backing off; 0: `hysteresis`
    skipped: int = 0  # steps skipped for an overflow, over the whole run (resumes included)

    def __post_init__(self):
        self.hysteresis_left = self.hysteresis_left or self.hysteresis

    @classmethod
    def of(cls, train) -> LossScaler:
        """From `train.loss_scale*` (a `TrainConfig`)."""
        dynamic = train.loss_scale == "dynamic"
        return cls(scale=float(train.loss_scale_init if dynamic else train.loss_scale),
                   dynamic=dynamic, growth_interval=train.loss_scale_growth_interval,
                   hysteresis=train.loss_scale_hysteresis, min_scale=train.loss_scale_min)

    def update(self, overflow: bool) -> None:
        """After a step: `overflow` is whether its gradients held a non-finite element."""
        if overflow:
            self.skipped += 1
        if not self.dynamic:
            return
        if not overflow:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker, self.hysteresis_left = 0, self.hysteresis
                self.scale *= 2.0
            return
        self.growth_tracker = 0
        self.hysteresis_left -= 1
        if self.hysteresis_left > 0:
            return
        if self.scale / 2.0 < self.min_scale:
            raise LossScaleTooSmall(
                f"train.loss_scale_min: the loss scale would fall below {self.min_scale:g} "
                f"(from {self.scale:g}) after {self.skipped} skipped steps; the gradients overflow "
                "fp16 even unscaled: lower train.lr, or use train.precision = 'bf16'")
        self.scale /= 2.0

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint's entries (`train.loss_scale*`, `train.skipped_steps`)."""
        return {
            "train.loss_scale": torch.tensor(self.scale, dtype=torch.float64),
            "train.loss_scale_growth_tracker": torch.tensor(self.growth_tracker),
            "train.loss_scale_hysteresis_left": torch.tensor(self.hysteresis_left),
            "train.skipped_steps": torch.tensor(self.skipped),
        }

    def load_state_tensors(self, sd: dict[str, torch.Tensor]) -> None:
        if self.dynamic:  # a static scale is the configuration's
            self.scale = float(sd["train.loss_scale"])
            self.growth_tracker = int(sd["train.loss_scale_growth_tracker"])
            self.hysteresis_left = int(sd["train.loss_scale_hysteresis_left"])
        self.skipped = int(sd["train.skipped_steps"])
