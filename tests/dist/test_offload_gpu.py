"""ZeRO offload on a GPU: masters and optimizer state in host memory, the update on the CPU, the
same training as without offload. Runs where CUDA exists; skipped elsewhere."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from training import tiny_config

from plait.checks import validate
from plait.mesh import build_mesh
from plait.train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def nccl_world_of_one():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()


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
