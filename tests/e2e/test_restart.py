"""A job that loses a worker: `plait train --max-restarts 1` restarts the workers, which resume
from the newest complete checkpoint; a resume on another world size keeps the run."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from test_cli import plait, plait_here, read_metrics

from plait.checkpoint.rank_state import load_full
from plait.train.faults import ENV

RUN = ["model.preset=tiny", "data.seq_len=32", "data.max_bytes=200000", "train.eval_batches=1",
       "train.global_batch=8", "train.steps=8", "train.warmup_steps=2", "checkpoint.every=2",
       "train.peak_tflops=1.0"]
FINAL = "step-00000008"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run no fault touches: its final checkpoint, metrics, and folder of checkpoints (all
    four kept)."""
    root = tmp_path_factory.mktemp("straight")
    proc = plait_here("train", "--nproc", "2", "--metrics", str(root / "m.jsonl"), *RUN,
                      f"checkpoint.dir={root / 'ck'}", "checkpoint.keep=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_full(root / "ck" / FINAL), read_metrics(root / "m.jsonl"), root / "ck"


def _faulty(tmp_path, fault):
    proc = plait("train", "--nproc", "2", "--max-restarts", "1", *RUN,
                 f"checkpoint.dir={tmp_path / 'ck'}", env={**os.environ, ENV: fault})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("fault,resumed", [("step:1:5", 4), ("save:1:4", 2)],
                         ids=["sigkill-mid-run", "sigkill-during-a-save"])
def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_nothing_happened(
        tmp_path, uninterrupted, fault, resumed):
    """Rank 1 is SIGKILLed at step 5, or while writing the checkpoint of step 4; the job restarts
    both workers, which resume from the newest complete checkpoint (step 4, or step 2: the one
    being written is not marked complete) and finish with exactly the uninterrupted run's
    parameters (same layout: bit-exact)."""
    out = _faulty(tmp_path, fault)
    assert f"resumed from {tmp_path / 'ck' / f'step-{resumed:08d}'} at step {resumed}" in out
    got = load_full(tmp_path / "ck" / FINAL)
    want, *_ = uninterrupted
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.slow
def test_resume_on_half_the_workers_keeps_the_global_batch(tmp_path, uninterrupted):
    """The uninterrupted run's checkpoint of step 4, saved by 2 workers, resumed on 1: dp 2 -> 1,
    each rank accumulates over 2 micro-batches of the same size as before, and the losses
    continue the uninterrupted run's (within fp32 summation order, 1e-5)."""
    _, straight, saved = uninterrupted
    metrics = tmp_path / "m.jsonl"
    second = plait("train", "--nproc", "1", "--metrics", str(metrics), *RUN,
                   f"checkpoint.dir={tmp_path / 'ck'}",
                   f"checkpoint.resume={saved / 'step-00000004'}")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming a run of 2 workers on 1: dp 2 -> 1" in second.stderr
    assert "parallel.microbatches 1 -> 2 per rank, of 4 sequences" in second.stderr
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(4, 8))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records]),
                               torch.tensor([r["loss"] for r in straight[4:]]), rtol=1e-5,
                               atol=0)
    assert json.loads((tmp_path / "ck" / FINAL / "plait.json").read_text())["world_size"] == 1


def test_torchrun_restarts_need_a_store_of_their_own(tmp_path, monkeypatch):
    """torchrun's own --max-restarts is refused up front while its shared store would hang the
    restart (checked in this process, with a torchrun worker's environment). With the store not
    shared, a torchrun job that loses a worker restarts and ends bit-exact:
    `tests/e2e/test_nodes.py` loses a whole node that way."""
    for key, value in {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2",
                       "TORCHELASTIC_MAX_RESTARTS": "1",
                       "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(key, value)
    refused = plait_here("train", *RUN, f"checkpoint.dir={tmp_path / 'ck'}")
    assert refused.returncode == 2 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in refused.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 300 KiB file system (tmpfs; root only), far below a checkpoint of the tiny model."""
    folder = tmp_path / "small"
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs",
                                            str(folder)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("background", ["false", "true"], ids=["sync", "async"])
def test_a_full_disk_during_a_save_is_said_and_the_partial_checkpoint_removed(small_disk,
                                                                             background):
    proc = plait("train", "--nproc", "2", *RUN[:-2], "train.steps=2",
                 f"checkpoint.dir={small_disk / 'ck'}", f"checkpoint.async={background}")
    assert proc.returncode == 1
    said = f"could not be written to {small_disk / 'ck' / 'step-00000002'}: No space left"
    assert said in proc.stderr, proc.stderr[-3000:]
    assert list((small_disk / "ck").iterdir()) == []  # nothing left to keep the disk full
    _is_one_short_report(proc.stderr, first=None)
    assert f"no complete checkpoint in {small_disk / 'ck'}" in proc.stderr


def _is_one_short_report(stderr: str, first: int | None, cause: str = "Traceback") -> None:
    """A failed job's report (`launch.report`): at most 15 lines in all, the first rank to fail
    named, no traceback on the screen, and the file that holds every rank's whole failure
    record, `cause` among them (was 80-105 lines of tracebacks: torch's agent's log of the
    failure, then its summary)."""
    lines = stderr.splitlines()
    assert len(lines) <= 15 and "Traceback" not in stderr, stderr
    failed = next(line for line in lines if line.startswith("plait: the job failed: rank"))
    if first is not None:
        assert failed.startswith(f"plait: the job failed: rank {first} first"), stderr
    log = lines[-1].removeprefix("plait: every rank's traceback: ")
    assert cause in open(log).read()
    os.unlink(log)


@pytest.mark.slow
def test_a_worker_killed_during_a_save_is_named_in_a_short_report(tmp_path):
    """Rank 1 SIGKILLed while it writes the checkpoint of step 4, no restarts: rank 0 then fails
    on the closed connection. The report names rank 1 first and the checkpoint of step 2, which
    was complete, as what was kept; its file holds rank 1's record, its SIGKILL. Whether it also
    holds rank 0's traceback is a race (torch's agent may stop rank 0 before its collective
    fails: seen once in a fresh clone's run), so that is not asserted."""
    proc = plait("train", "--nproc", "2", *RUN, f"checkpoint.dir={tmp_path / 'ck'}",
                 env={**os.environ, ENV: "save:1:4"})
    assert proc.returncode == 1
    _is_one_short_report(proc.stderr, first=1, cause="SIGKILL")
    assert f"the last complete checkpoint: {tmp_path / 'ck' / 'step-00000002'}" in proc.stderr
