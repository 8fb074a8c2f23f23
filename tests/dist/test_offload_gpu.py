"""ZeRO on a GPU: ZeRO-3 (its units' memory from the caching allocator, not the host pool)
trains what the unsharded model trains; offload keeps masters and optimizer state in host memory, the update on
the CPU, the same training as without offload. Runs where CUDA exists; skipped elsewhere."""

import pytest
import torch
from training import assert_params_close, held_params, tiny_config

from plait.train.checks import validate
from plait.mesh import build_mesh
from plait.parallel.engines import buffer_pool
from plait.train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _train(cfg):
    dims = validate(cfg, 1)
    trainer = Trainer(cfg, dims, build_mesh(dims, "cuda"), torch.device("cuda", 0))
    summary = trainer.fit()
    return trainer, summary.losses


@pytest.mark.parametrize("stage,offload", [(2, "optimizer"), (3, "optimizer"), (3, "params")])
def test_offload_keeps_optimizer_state_on_the_host(nccl_world_of_one, stage, offload):
    common = [f"parallel.zero={stage}", "train.precision=bf16"]
    _, expected = _train(tiny_config(*common))
    trainer, losses = _train(tiny_config(*common, f"parallel.offload={offload}"))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-3, atol=0)
    masters = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert all(m.device.type == "cpu" and m.dtype == torch.float32 for m in masters)
    for state in trainer.optimizer.state.values():
        assert all(t.device.type == "cpu" for t in state.values() if torch.is_tensor(t))
    assert all(p.device.type == "cuda" for p in trainer.model.parameters())


def test_zero3_on_cuda_trains_what_one_device_trains(nccl_world_of_one, monkeypatch):
    monkeypatch.setattr(buffer_pool, "SMALLEST", 0)  # pooled if the pool took CUDA storages
    # float32 on one GPU: the same kernels on the same values in both runs, only where the
    # weights live differs (flat buffers gathered and freed per unit), so assert_params_close's
    # summation-order tolerance is ample; a unit freed while still in use, or read before its
    # gather landed, changes most elements by ~lr.
    reference, expected = _train(tiny_config())
    trainer, losses = _train(tiny_config("parallel.zero=3"))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    want = held_params(reference)
    for name, got in held_params(trainer).items():
        assert_params_close(got.cpu(), want[name].cpu(), name)
    assert trainer.parallelized.engine.buffers._most == 0  # the caching allocator served them
