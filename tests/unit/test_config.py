"""Configuration loading, and bad input: status 2 and one line naming the field, before any worker
starts."""

import subprocess
import sys

import pytest

from plait import cli
from plait.config import ConfigError, load_config, validate


def test_overrides_are_typed_and_layered(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[train]\nsteps = 7\nlr = 1\n[model]\npreset = "small"\nn_layers = 2\n')
    cfg = load_config(recipe, ["train.steps=9", "data.source=/some/where.txt", "model.dim=96"])
    assert cfg.train.steps == 9 and cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.data.source == "/some/where.txt"
    args = cfg.model.args()
    assert (args.dim, args.n_layers, args.n_heads) == (96, 2, 6)  # preset, then file, then CLI


def test_a_replaced_key_names_its_replacement():
    with pytest.raises(ConfigError, match="parallel.microbatches") as e:
        load_config(None, ["train.micro_batch=2"])
    assert e.value.field == "train.micro_batch"


def test_dp_takes_what_the_world_leaves():
    assert validate(load_config(None, []), 4).dp == 4
    assert validate(load_config(None, ["parallel.dp=2"]), 2).dp == 2


@pytest.fixture
def no_launch(monkeypatch):
    """Bad input must be refused before any worker starts: starting one fails the test."""
    import plait.launch

    def forbidden(*args, **kwargs):
        raise AssertionError("a worker was launched for bad input")

    monkeypatch.setattr(plait.launch, "launch", forbidden)


BAD_INPUT = [
    # (arguments, the field the one-line message must name)
    (["model.nonsense=1"], "model.nonsense"),
    (["train.stepz=3"], "train.stepz"),
    (["optimizer.lr=1"], "optimizer.lr"),
    (["train.steps=many"], "train.steps"),
    (["train.steps"], "train.steps"),
    (["parallel.tp=2", "--nproc", "3"], "parallel"),
    (["parallel.dp=2", "--nproc", "4"], "parallel"),
    (["parallel.tp=3", "parallel.dp=1", "--nproc", "3"], "parallel.tp"),
    (["parallel.pp=3", "parallel.dp=1", "--nproc", "3"], "parallel.pp"),
    (["parallel.pp_schedule=2f2b"], "parallel.pp_schedule"),
    (["parallel.pp=2", "parallel.dp=1", "--nproc", "2", "parallel.microbatches=3"],
     "parallel.microbatches"),
    (["parallel.pp=2", "parallel.dp=1", "--nproc", "2", "parallel.pp_schedule=interleaved",
      "model.n_layers=4", "parallel.microbatches=3", "train.global_batch=6"],
     "parallel.microbatches"),
    (["parallel.pp=2", "parallel.dp=1", "--nproc", "2", "parallel.pp_split=[1, 2]"],
     "parallel.pp_split"),
    (["parallel.pp_split=[1, \"a\"]"], "parallel.pp_split"),
    (["parallel.pp=2", "parallel.dp=1", "--nproc", "2", "train.micro_batch=4"],
     "train.micro_batch"),  # replaced: the message names parallel.microbatches
    (["parallel.microbatches=3"], "parallel.microbatches"),
    (["parallel.dp_shard=3"], "parallel.dp_shard"),
    (["parallel.dp_shard=2"], "parallel.dp_shard"),  # hybrid sharding without ZeRO
    (["train.activation_checkpointing=some"], "train.activation_checkpointing"),
    (["train.device=tpu"], "train.device"),
    (["parallel.pp=2", "--nproc", "2", "parallel.pp_schedule=zb1",
      "train.activation_checkpointing=full"], "train.activation_checkpointing"),
    (["parallel.tp=4", "parallel.dp=1", "--nproc", "4"], "parallel.tp"),  # 2 kv heads
    (["parallel.tp=4", "parallel.dp=1", "--nproc", "4", "model.n_heads=8", "model.n_kv_heads=4",
      "model.vocab_size=258"], "parallel.tp"),
    (["parallel.tp=2", "parallel.dp=1", "--nproc", "2", "parallel.sequence_parallel=true",
      "data.seq_len=33"], "parallel.sequence_parallel"),
    (["parallel.sequence_parallel=yes"], "parallel.sequence_parallel"),
    (["parallel.dp=-1"], "parallel.dp"),
    (["train.global_batch=30", "--nproc", "4"], "train.global_batch"),
    (["train.micro_batch=3"], "train.micro_batch"),
    (["model.preset=huge"], "model.preset"),
    (["model.n_kv_heads=4"], "model.n_kv_heads"),
    (["train.precision=fp8"], "train.precision"),
    (["data.seq_len=100000"], "data.seq_len"),
    (["data.source=/no/such/file.txt"], "data.source"),
    (["train.warmup_steps=-1"], "train.warmup_steps"),
    (["--config", "/no/such/recipe.toml"], "--config"),
    (["--nproc", "zero"], "--nproc"),
]


@pytest.mark.parametrize("argv,field", BAD_INPUT, ids=[f for _, f in BAD_INPUT])
def test_bad_input_exits_2_with_one_line(argv, field, no_launch, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"plait: error: {field}") or f"argument {field}" in err, err


def test_bad_input_from_a_real_process():
    """The same through the installed entry point: status 2, one line on stderr, nothing else."""
    proc = subprocess.run(
        [sys.executable, "-m", "plait", "train", "parallel.tp=5", "parallel.dp=1", "--nproc", "5"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "plait: error: parallel.tp: tp=5 must divide n_heads=6 and n_kv_heads=2"
    ]


def test_unimplemented_axes_are_refused_not_ignored():
    with pytest.raises(ConfigError, match="parallel.cp: not implemented"):
        validate(load_config(None, ["parallel.cp=2"]), 2)
