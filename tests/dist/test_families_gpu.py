"""Every family of `plait/model/families/` (and the unplanned ones the suite trains) on a GPU:
plait's trainer on one CUDA device, each block compiled by inductor (`train.compile=true`:
Triton kernels, which the CPU suite's "aot_eager" rows never generate), equals the transformers
module trained eagerly in one process on the CPU, on the same batches. Runs where CUDA exists;
skipped elsewhere.

Tolerance: float32 on both sides (CUDA's float32 matmuls are not TF32 unless asked), but other
kernels: cuBLAS and inductor's fused reductions against the CPU's, each summing in its own
order. Losses relative 1e-5 as the composition matrix's; parameters by `assert_params_close`,
whose allowance for elements at the summation noise is the same kind of noise (a real error, a
block computed wrongly by its compiled graph or a gradient lost at a graph's edge, moves most of
a tensor's elements by ~lr)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from hf_models import families, hf_config, reference_of, train_reference, write_model
from torch._dynamo.utils import counters
from training import assert_params_close, held_params

from plait.mesh import build_mesh
from plait.model.families import family_for
from plait.model.hf import read_config
from plait.parallel.compile import compiled_graphs
from plait.train.checks import validate
from plait.train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 4


def compiled_run_equals_reference(folder, device: torch.device) -> int:
    """Train the model of `folder` compiled on `device`, assert it equals the transformers module
    trained in this process on the CPU; the number of graphs compiled."""
    cfg = hf_config(folder, "train.compile=true", steps=STEPS)
    ref = train_reference(folder, cfg, STEPS)
    dims = validate(cfg, 1)
    trainer = Trainer(cfg, dims, build_mesh(dims, device.type), device)
    losses = [trainer._global_mean(trainer.train_step(step)["loss"]) for step in range(STEPS)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]),
                               rtol=1e-5, atol=0)
    planned, seen = family_for(read_config(folder)), set()
    for name, got in held_params(trainer).items():
        want, hf = reference_of(name, planned, ref["params"], folder)
        assert_params_close(got.cpu(), want, name, steps=STEPS)
        seen.add(hf)
    assert seen == set(ref["params"])  # every parameter trained (a tied head counts once)
    return compiled_graphs()


@pytest.mark.parametrize("family", sorted(families()))
def test_a_family_compiled_on_cuda_trains_what_transformers_trains(nccl_world_of_one, tmp_path,
                                                                   family):
    torch._dynamo.reset()  # each family's graphs compiled afresh, counted from 0
    counters.clear()
    folder = write_model(tmp_path / family, family)
    assert compiled_run_equals_reference(folder, torch.device("cuda", 0)) > 0
