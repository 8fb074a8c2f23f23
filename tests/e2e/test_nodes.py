"""Two emulated nodes (`plait/nodes.py`: network namespaces on a bridge, the link between them
shaped by tc) running one torchrun job with a c10d rendezvous: the run equals one process, and
nothing of the cluster is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from test_cli import TINY, plait_here, read_metrics
from training import assert_params_close

from plait.checkpoint.rank_state import load_full
from plait.nodes import EmulatedNodes, available

WHY = available()
RUN = [*TINY, "train.peak_tflops=1.0"]


def _leftovers() -> str:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return "\n".join(line for line in (namespaces + links).splitlines() if "plait" in line)


def _same_as_one_process(tmp_path, nodes_of: int, overrides: list[str], steps: int,
                         plaits_launcher: bool = False) -> None:
    """`plait train` with `overrides` as one process, then on 2 emulated nodes of `nodes_of`
    processes (the link between them shaped to 1 Gbit/s), started by torchrun or by plait's own
    launcher given torchrun's multi-node arguments: losses (rtol 1e-5), and parameters after the
    last step (`assert_params_close`), equal; nothing of the nodes left behind."""
    one = plait_here("train", "--metrics", tmp_path / "one.jsonl", *overrides,
                     f"checkpoint.dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr
    args = ["-m", "plait", "train", "--metrics", str(tmp_path / "two.jsonl"), *overrides,
            f"checkpoint.dir={tmp_path / 'two'}"]
    with EmulatedNodes(2, rate_mbit=1000) as nodes:
        logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]  # noqa: SIM115
        own = [[sys.executable, *args, "--nnodes", "2", "--nproc", str(nodes_of),
                "--rdzv-endpoint", f"{nodes.address(0)}:29500", "--local-addr", nodes.address(i)]
               for i in range(2)]
        procs = [nodes.start(i, own[i], stdout=logs[i], stderr=subprocess.STDOUT)
                 if plaits_launcher else
                 nodes.torchrun(i, nodes_of, args, stdout=logs[i], stderr=subprocess.STDOUT)
                 for i in range(2)]
        codes = [p.wait(timeout=240) for p in procs]
    assert codes == [0, 0], (tmp_path / "node0.log").read_text()[-3000:]
    assert _leftovers() == ""
    assert plait_here("compare", tmp_path / "one.jsonl", tmp_path / "two.jsonl").returncode == 0
    assert len(read_metrics(tmp_path / "two.jsonl")) == steps
    want = load_full(tmp_path / "one" / f"step-{steps:08d}")
    got = load_full(tmp_path / "two" / f"step-{steps:08d}")
    assert got.keys() == want.keys()
    for name in want:
        assert_params_close(got[name], want[name], name, steps=steps)


@pytest.mark.skipif(bool(WHY), reason=f"emulated nodes: {WHY}")
def test_two_nodes_of_two_train_dp2_x_tp2_as_one_process(tmp_path):
    """dp2 x tp2 on 2 nodes of 2 processes: tp inside each node (a node's processes get
    consecutive ranks; tp is the mesh's innermost axis), dp across. Each node runs `plait train
    --nnodes 2 --nproc 2 --rdzv-endpoint NODE0:PORT`, which becomes that node's torchrun (node
    0 hosting the rendezvous: the endpoint's address is its own)."""
    _same_as_one_process(tmp_path, 2, [*RUN, "parallel.tp=2"], 4, plaits_launcher=True)


@pytest.mark.skipif(bool(WHY), reason=f"emulated nodes: {WHY}")
def test_the_3d_recipe_on_two_nodes_of_four_as_one_process(tmp_path):
    """The 3-D recipe (pp2 x dp2 x tp2, interleaved, ZeRO-1) on 2 nodes of 4 processes: tp and dp
    inside each node, the pipeline's two stages one per node, so activations and their gradients
    cross the link. Cut to 3 steps of 8 x 64 tokens (its 4 micro-batches of one row)."""
    _same_as_one_process(tmp_path, 4, [
        "--config", "3d", "train.steps=3", "train.global_batch=8", "data.seq_len=64",
        "train.eval_every=0", "train.eval_batches=1", "data.max_bytes=400000",
        "train.peak_tflops=1.0"], 3)


@pytest.mark.skipif(bool(WHY), reason=f"emulated nodes: {WHY}")
def test_a_lost_node_leaves_the_job_to_the_other_and_the_run_ends_bit_exact(tmp_path):
    """dp2 on 2 nodes of 1 process, torchrun --nnodes 1:2 --max-restarts 1, a checkpoint every 2
    of 8 steps. Node 1 is lost before step 5 (its process kills torchrun's agent and itself:
    nothing restarts it). Node 0's agent restarts its worker, the rendezvous closes with the one
    node left, and the job resumes from step 4 on 1 process, dp 2 -> 1 with 2 micro-batches of the
    same rows each (the global batch kept). The final parameters equal the uninterrupted dp2
    run's bit for bit: the same rows per forward, and (g0 + g1) / 2 on two ranks is
    g0 / 2 + g1 / 2 accumulated on one, halving being exact."""
    from plait.train.faults import ENV

    run = [*RUN, "train.steps=8", "checkpoint.every=2", "train.warmup_steps=2"]
    straight = plait_here("train", "--nproc", "2", *run, f"checkpoint.dir={tmp_path / 'one'}")
    assert straight.returncode == 0, straight.stderr
    args = ["-m", "plait", "train", *run, f"checkpoint.dir={tmp_path / 'two'}"]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # see cli/commands.py: #135712
    # The lost node leaves the rendezvous once its heartbeat is keep_alive_interval x
    # max_attempt old: 4 s here, not the default 15 (the test's time, not what it shows).
    conf = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=4"
    with EmulatedNodes(2, rate_mbit=1000) as nodes:
        logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]  # noqa: SIM115
        procs = [nodes.torchrun(i, 1, args, env={**env, **({ENV: "node:0:5"} if i else {})},
                                nnodes="1:2", launcher=("--max-restarts", "1"),
                                rdzv_conf=conf, stdout=logs[i], stderr=subprocess.STDOUT)
                 for i in range(2)]
        codes = [p.wait(timeout=240) for p in procs]
    out = (tmp_path / "node0.log").read_text()
    assert codes[0] == 0 and codes[1] == -signal.SIGKILL, out[-3000:]
    assert _leftovers() == ""
    assert "resuming a run of 2 workers on 1: dp 2 -> 1" in out, out[-3000:]
    assert f"resumed from {tmp_path / 'two' / 'step-00000004'} at step 4" in out
    want = load_full(tmp_path / "one" / "step-00000008")
    got = load_full(tmp_path / "two" / "step-00000008")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
