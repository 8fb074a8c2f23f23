"""`plait train model.hf=DIR`: a folder written by transformers' `save_pretrained` trains under
tensor parallelism on 2 workers, saves a sharded checkpoint, resumes it on one process, and
`plait convert --to hf` writes a folder that transformers loads with no missing key and the
checkpoint's weights, computing the same logits as plait's pieces of the model."""

from __future__ import annotations

import json

import torch
from hf_models import write_model
from test_cli import plait_here, read_metrics

from plait.checkpoint import complete_checkpoints
from plait.checkpoint.rank_state import load_full

COMMON = ["data.seq_len=32", "train.global_batch=8", "train.steps=4", "train.warmup_steps=1",
          "train.eval_batches=1"]


def test_train_a_hf_folder_under_tp_save_resume_elsewhere_and_convert(tmp_path):
    transformers = __import__("transformers")
    folder = write_model(tmp_path / "llama", "llama")
    ck, first, second = tmp_path / "ck", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    proc = plait_here("train", f"model.hf={folder}", "--nproc", "2", "parallel.tp=2",
                      "train.stop_after=2", f"checkpoint.dir={ck}", "--metrics", first, *COMMON)
    assert proc.returncode == 0, proc.stderr
    assert [m["step"] for m in read_metrics(first)] == [0, 1]
    saved = complete_checkpoints(ck)
    assert [p.name for p in saved] == ["step-00000002"]
    assert json.loads((saved[0] / "plait.json").read_text())["config"]["model"] == \
        {"hf": str(folder)}

    proc = plait_here("train", f"model.hf={folder}", f"checkpoint.dir={ck}",
                      "--metrics", second, *COMMON)  # one process: another layout
    assert proc.returncode == 0, proc.stderr
    resumed = read_metrics(second)
    assert [m["step"] for m in resumed] == [2, 3]
    assert resumed[-1]["loss"] < read_metrics(first)[0]["loss"]

    out = tmp_path / "exported"
    proc = plait_here("convert", "--to", "hf", out, ck)
    assert proc.returncode == 0, proc.stderr
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, dtype=torch.float32, attn_implementation="sdpa")
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    weights = load_full(complete_checkpoints(ck)[-1])
    assert len(weights) == len(dict(hf.named_parameters()))
    for name, p in hf.named_parameters():
        plait_name = name.removeprefix("model.")
        torch.testing.assert_close(p, weights[plait_name], rtol=0, atol=0, msg=name)
    from plait.model.hf import load_hf

    ours = load_hf(out).eval()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf.eval()(input_ids=tokens).logits,
                                   rtol=0, atol=0)


def test_verify_compares_one_step_of_the_layout_with_one_process(tmp_path):
    """`plait train --verify` on a Hugging Face Llama at tp2 x pp2: every parameter group of the
    transformers model within tolerance, status 0, nothing trained or written."""
    folder = write_model(tmp_path / "llama", "llama")
    proc = plait_here("train", "--verify", f"model.hf={folder}", "--nproc", "4", "parallel.tp=2",
                      "parallel.pp=2", *COMMON)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("verify: ok"), proc.stdout
    groups = {line.split()[0] for line in lines[2:-1]}
    assert {"embed_tokens.weight", "layers.*.self_attn.q_proj.weight", "lm_head.weight",
            "layers.*.mlp.down_proj.weight", "norm.weight"} <= groups


def test_bench_step_runs_a_hf_model_against_torchs_peers_and_plaits_llama(tmp_path):
    """ZeRO-3 against fully_shard and plait's Llama, and tp against DTensor with the model's own
    tp plan: runs, and has every column; no timing is asserted (timings live in the bench)."""
    folder = write_model(tmp_path / "llama", "llama")
    proc = plait_here("bench", "step", "--nproc", "1", "--steps", "1", "--repeats", "1",
                      "parallel.zero=3", f"model.hf={folder}", "data.seq_len=32",
                      "train.global_batch=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fully_shard" in proc.stdout and "Llama (ms)" in proc.stdout and "HF /" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["1"]
    assert all(len(row.split("│")) == 14 for row in rows)  # 12 columns
    proc = plait_here("bench", "step", "--nproc", "2", "--steps", "1", "--repeats", "1",
                      "parallel.tp=2", f"model.hf={folder}", "data.seq_len=32",
                      "train.global_batch=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for variant in ("plait TP", "plait TP + sequence parallel", "torch DTensor TP"):
        assert variant in proc.stdout, variant
