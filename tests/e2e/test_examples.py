"""Every example in examples/ runs, through `plait run` as a user would start it.

The runs whose output a test reads are new `plait run` processes (their workers print to that
process's output, captured here); the failing script runs in this process (what is read is the
launcher's report)."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
from pathlib import Path

import pytest
from test_cli import plait, plait_here

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _losses(text: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step +\d+ +loss ([0-9.]+)$", text, re.M)]


def test_digits_classifier_learns_under_zero3_on_two_ranks():
    proc = plait("run", "--nproc", "2", EXAMPLES / "digits_zero3.py", "--steps", "40")
    assert proc.returncode == 0, proc.stderr
    losses = _losses(proc.stdout)
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0], proc.stdout  # 2.34 -> 0.78
    accuracy = float(re.search(r"test accuracy ([0-9.]+) on 296 images", proc.stdout)[1])
    assert accuracy > 0.8, proc.stdout  # 0.885 measured; chance is 0.1


def test_the_converted_script_prints_the_single_device_scripts_losses():
    """The exercise: the same script on one device and, converted, on 2 ranks under ZeRO-2 gives
    the same losses (relative 1e-5: float32, the gradient averaged in another order)."""
    single = io.StringIO()  # the plain script needs no new interpreter: run it here
    with contextlib.redirect_stdout(single):
        runpy.run_path(str(EXAMPLES / "convert" / "single_device.py"), run_name="__main__")
    converted = plait("run", "--nproc", "2", EXAMPLES / "convert" / "with_plait.py",
                      "--zero", "2")
    assert converted.returncode == 0, converted.stderr
    want = _losses(single.getvalue())
    assert len(want) == 5
    assert _losses(converted.stdout) == pytest.approx(want, rel=1e-5)


def test_a_failing_script_brings_the_run_down_with_its_traceback(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import plait, torch.distributed as dist\n"
                      "plait.init()\n"
                      "if dist.get_rank() == 1:\n"
                      "    raise RuntimeError('rank one gives up')\n"
                      "dist.barrier()\n")
    proc = plait_here("run", "--nproc", "2", script)  # its traceback reaches the launcher
    assert proc.returncode == 1
    assert "RuntimeError: rank one gives up" in proc.stderr


def test_a_missing_script_is_one_line_and_status_2(tmp_path):
    proc = plait_here("run", "--nproc", "2", tmp_path / "nowhere.py")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"plait: error: script: {tmp_path / 'nowhere.py'} is not a " \
                                  "file; give the path of a .py file"


def test_hf_causal_lm_trains_at_dp2_tp2_pp2():
    """8 ranks, forked after transformers was imported once (`--preload`)."""
    proc = plait("run", "--nproc", "8", "--preload", "transformers.modeling_utils",
                 "--preload", "transformers.models.llama.modeling_llama",
                 EXAMPLES / "hf_causal_lm.py", "--steps", "3", timeout=300)
    assert proc.returncode == 0, proc.stderr
    losses = _losses(proc.stdout)
    assert len(losses) == 3 and losses[-1] < losses[0], proc.stdout  # 5.55 -> 4.95
