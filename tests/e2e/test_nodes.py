"""Two emulated nodes (`plait/nodes.py`: network namespaces on a bridge, the link between them
shaped by tc) running one torchrun job with a c10d rendezvous: the run equals one process, and
nothing of the cluster is left behind."""

from __future__ import annotations

import subprocess

import pytest
from test_cli import TINY, plait_here, read_metrics
from training import assert_params_close

from plait.checkpoint import load_full
from plait.nodes import EmulatedNodes, available

WHY = available()
RUN = [*TINY, "train.peak_tflops=1.0"]


def _leftovers() -> str:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return "\n".join(line for line in (namespaces + links).splitlines() if "plait" in line)


@pytest.mark.skipif(bool(WHY), reason=f"emulated nodes: {WHY}")
def test_two_nodes_of_two_train_dp2_x_tp2_as_one_process(tmp_path):
    """dp2 x tp2 on 2 nodes of 2 processes, the link between them shaped to 1 Gbit/s: tp inside
    each node (a node's processes get consecutive ranks; tp is the mesh's innermost axis), dp
    across. Losses (rtol 1e-5) and the parameters after the 4 steps (`assert_params_close`) equal
    one process's; the namespaces, veth pairs and bridge are gone afterwards."""
    one = plait_here("train", "--metrics", tmp_path / "one.jsonl", *RUN,
                     f"checkpoint.dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr
    args = ["-m", "plait", "train", "--metrics", str(tmp_path / "two.jsonl"), *RUN,
            "parallel.tp=2", f"checkpoint.dir={tmp_path / 'two'}"]
    with EmulatedNodes(2, rate_mbit=1000) as nodes:
        logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]  # noqa: SIM115
        procs = [nodes.torchrun(i, 2, args, stdout=logs[i], stderr=subprocess.STDOUT)
                 for i in range(2)]
        codes = [p.wait(timeout=240) for p in procs]
    assert codes == [0, 0], (tmp_path / "node0.log").read_text()[-3000:]
    assert _leftovers() == ""
    assert plait_here("compare", tmp_path / "one.jsonl", tmp_path / "two.jsonl").returncode == 0
    assert len(read_metrics(tmp_path / "two.jsonl")) == 4
    want = load_full(tmp_path / "one" / "step-00000004")
    got = load_full(tmp_path / "two" / "step-00000004")
    assert got.keys() == want.keys()
    for name in want:
        assert_params_close(got[name], want[name], name)
