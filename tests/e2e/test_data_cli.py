"""`plait data prepare` then `plait train` on it: docs/data.md's walk-through as written, a resume
on another world size mid-epoch, and a corpus of uint32 ids."""

import json
import math
import shlex
from pathlib import Path

import pytest
from corpora import word_level_tokenizer
from test_cli import plait_here, read_metrics

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.preset=tiny", "model.vocab_size=2048", "data.seq_len=32", "train.global_batch=32",
         "train.eval_batches=1", "train.warmup_steps=1"]


def walkthrough(runs: Path) -> list[list[str]]:
    """docs/data.md's two commands, with its paths made absolute and runs/ moved to `runs`."""
    text = (ROOT / "docs" / "data.md").read_text()
    block = text.split("```sh\n")[1].split("```")[0]

    def place(word: str) -> str:
        key, _, value = word.rpartition("=")
        if value.startswith("runs/"):
            value = str(runs / value[len("runs/"):])
        elif not word.startswith("-") and (ROOT / value).exists() and not key:
            value = str(ROOT / value)
        return f"{key}={value}" if key else value

    lines = [shlex.split(line) for line in block.strip().splitlines()]
    return [[words[0], *map(place, words[1:])] for words in lines]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """docs/data.md's corpus (README, docs, plait's source on a BPE of 2,048 tokens), and the run
    it shows, cut to 4 steps."""
    runs = tmp_path_factory.mktemp("runs")
    prepare, train = walkthrough(runs)
    assert prepare[:3] == ["plait", "data", "prepare"] and train[:2] == ["plait", "train"]
    done = plait_here(*prepare[1:])
    assert done.returncode == 0, done.stderr
    pictures = len(list((ROOT / "docs").glob("*.png")))  # not text: skipped, and said
    assert f"skipped {pictures} file(s) that are not UTF-8 text" in done.stdout
    run = plait_here(*train[1:], "train.steps=4", "train.eval_batches=1")
    assert run.returncode == 0, run.stderr
    return runs


def test_the_documented_walkthrough_trains_on_a_bpe_vocabulary(bpe):
    manifest = json.loads((bpe / "corpus" / "manifest.json").read_text())
    assert manifest["vocab_size"] == 2048 and manifest["dtype"] == "uint16"
    metrics = read_metrics(bpe / "bpe.jsonl")
    # A fresh model's loss is that of a uniform guess over the vocabulary, then it falls.
    assert metrics[0]["loss"] == pytest.approx(math.log(2048), abs=0.3)
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3  # measured: 7.67 -> 7.09
    windows = round(32 / metrics[0]["epoch"])  # the default recipe's batch: 32 windows a step
    assert [m["epoch"] for m in metrics] == pytest.approx([32 * (s + 1) / windows
                                                           for s in range(4)])


def test_a_resume_on_another_world_size_mid_epoch_continues_the_same_batches(tmp_path):
    """A corpus cut to 4.4 steps an epoch (one document of 4,900 bytes: 141 training windows of
    33): steps 0-2 on 1 rank, then steps 3-7 on 4 ranks (the second epoch starts inside them)
    give the losses of 8 steps on 1 rank, to float32's reduction order (rtol 1e-5, `plait
    compare`'s default)."""
    source = ROOT / "plait" / "parallel" / "compose.py"  # one text file: one document
    common = [f"data.source={source}", "data.max_bytes=4900", *SMALL, "train.steps=8"]
    a, b, ck = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "ck"
    assert plait_here("train", "--nproc", "1", "--metrics", a, *common).returncode == 0
    first = plait_here("train", "--nproc", "1", "--metrics", b, *common, f"checkpoint.dir={ck}",
                       "train.stop_after=3")
    assert first.returncode == 0 and "data.max_bytes = 4,900" in first.stderr
    assert plait_here("train", "--nproc", "4", "--metrics", b, *common,
                      f"checkpoint.dir={ck}").returncode == 0
    whole, resumed = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in resumed] == list(range(8))
    assert whole[3]["epoch"] < 1 < whole[5]["epoch"] < 2  # the resume is mid-epoch 0
    assert [m["epoch"] for m in resumed] == [m["epoch"] for m in whole]
    assert plait_here("compare", a, b).returncode == 0


def test_a_corpus_of_uint32_ids_trains(tmp_path):
    """A word-level vocabulary of 70,001 tokens: ids beyond uint16, stored as uint32, train."""
    tokenizer = word_level_tokenizer(tmp_path / "tokenizer.json", 70_000)
    (tmp_path / "doc.txt").write_text(" ".join(f"w{i % 70_000}" for i in range(60_000, 66_000)))
    done = plait_here("data", "prepare", tmp_path / "doc.txt", tmp_path / "ids", "--tokenizer",
                      tokenizer)
    assert done.returncode == 0 and "uint32" in done.stdout
    metrics = tmp_path / "m.jsonl"
    run = plait_here("train", "--nproc", "1", "--metrics", metrics, f"data.source={tmp_path}/ids",
                     "model.preset=tiny", "model.vocab_size=70001", "data.seq_len=16",
                     "train.global_batch=2", "train.steps=1", "train.eval_batches=1")
    assert run.returncode == 0, run.stderr
    assert read_metrics(metrics)[0]["loss"] == pytest.approx(math.log(70_001), abs=0.3)


def test_a_50_gb_corpus_launches_and_trains_reading_a_bounded_part_of_it(tmp_path):
    """A prepared corpus of 50 GiB (sparse shards of zeros, as prepare lays them out) launches
    and trains a step while what is read of it stays bounded by what the checks and the step
    touch, whatever the corpus's size. Counted as the shards' bytes in the page cache afterwards
    (mincore: fresh files have none, and reading a hole caches it), so every process is seen."""
    from plait.bench.data import sparse_corpus
    from plait.data.corpus import BLOCK_BYTES, SAMPLE_BLOCKS
    from plait.host_memory import cached_bytes

    probe = tmp_path / "probe.bin"
    with open(probe, "wb") as f:
        f.truncate(1 << 30)
    with open(probe, "rb") as f:
        f.seek(1 << 29)
        f.read(1 << 20)
    if cached_bytes(probe) < 1 << 20:
        pytest.skip("this file system keeps no page cache for a sparse file's holes")
    folder = tmp_path / "big"
    manifest = sparse_corpus(folder, 50 << 30)
    shards = sorted(folder.glob("shard-*.bin"))
    assert sum(f.stat().st_size for f in shards) >= 50 << 30 and len(shards) == 100
    assert sum(cached_bytes(f) for f in shards) == 0
    batch, evals = 32, 1
    proc = plait_here("train", "--nproc", "1", f"data.source={folder}", *SMALL[:3],
                      "train.steps=1", f"train.global_batch={batch}",
                      f"train.eval_batches={evals}", "train.warmup_steps=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    read = sum(cached_bytes(f) for f in shards)
    # The launch's sample (in the launcher and again in the worker: the page cache counts it
    # once), then the step's and the validation's windows: each of 33 ids lies in at most two
    # blocks, and each block touched is read whole (for its checksum), nothing around it.
    bound = (SAMPLE_BLOCKS + 2 * batch * (1 + evals)) * BLOCK_BYTES
    assert 0 < read <= bound, (read, bound)
    print(f"\n{manifest['tokens'] * 2 / (1 << 30):.0f} GiB corpus: {read / (1 << 20):.1f} MiB "
          f"read by the launch and one step (bound {bound / (1 << 20):.1f} MiB)")


@pytest.mark.slow
def test_a_mixture_resumes_bit_exact_after_a_kill_and_says_a_reweighing(tmp_path):
    """Two prepared corpora at 0.25 / 0.75 on 2 ranks: rank 1 SIGKILLed at step 5 restarts from
    step 4 and ends with the uninterrupted run's parameters, bit for bit (a step's rows are a
    function of the step); resumed again with other weights, the run says so once."""
    import os

    import torch
    from test_cli import plait

    from plait.checkpoint.rank_state import load_full
    from plait.train.faults import ENV

    for name, letters in (("web", "abcde"), ("code", "vwxyz")):
        (tmp_path / name).mkdir()
        for i in range(4):
            (tmp_path / name / f"{i}.txt").write_text(f"{letters}{i} " * 400)
        assert plait_here("data", "prepare", str(tmp_path / name), str(tmp_path / f"{name}_ids"),
                          "--tokenizer", "bytes").returncode == 0

    def mixture(web: float, code: float) -> str:
        return (f'data.sources=[{{path="{tmp_path / "web_ids"}", weight={web}, name="web"}}, '
                f'{{path="{tmp_path / "code_ids"}", weight={code}, name="code"}}]')

    run = [*SMALL, "model.vocab_size=256", "train.global_batch=8", "train.steps=6",
           "checkpoint.every=2", "checkpoint.keep=4", mixture(0.25, 0.75)]
    straight = plait_here("train", "--nproc", "2", "--metrics", str(tmp_path / "m.jsonl"), *run,
                          f"checkpoint.dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    metrics = read_metrics(tmp_path / "m.jsonl")
    assert {"epoch/web", "epoch/code", "tokens/web", "tokens/code", "val_loss/web",
            "val_loss/code"} <= set(metrics[-1])
    assert metrics[-1]["val_loss/web"] != metrics[-1]["val_loss/code"]  # each its own split
    assert metrics[-1]["tokens/web"] + metrics[-1]["tokens/code"] == 6 * 8 * 32
    killed = plait("train", "--nproc", "2", "--max-restarts", "1", *run,
                   f"checkpoint.dir={tmp_path / 'killed'}", env={**os.environ, ENV: "step:1:5"})
    assert killed.returncode == 0, killed.stderr[-3000:]
    want = load_full(tmp_path / "straight" / "step-00000006")
    got = load_full(tmp_path / "killed" / "step-00000006")
    for name in want:
        assert torch.equal(got[name], want[name]), name
    more = plait("train", "--nproc", "2", *run[:-3], "train.steps=8", mixture(0.5, 0.5),
                 f"checkpoint.dir={tmp_path / 'straight'}")
    assert more.returncode == 0, more.stderr[-3000:]
    said = "data.sources reweighed from step 6: code 0.5 (was 0.75), web 0.5 (was 0.25)"
    assert (more.stdout + more.stderr).count(said) == 1
