"""The real thing: `plait train` launching workers through the elastic launcher, and torchrun."""

import ast
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import workers

from plait import forkserver
from plait.launch import ChildFailedError, launch

TINY = ["model.preset=tiny", "data.seq_len=32", "data.max_bytes=200000", "train.eval_batches=1",
        "train.global_batch=8", "train.steps=4", "train.warmup_steps=1",
        "train.peak_tflops=1.0"]  # MFU's peak given: no 0.3 s matmul measurement per run
FIELDS = {"step", "loss", "lr", "tokens", "step_time_s", "tokens_per_s", "mfu", "comm_bytes",
          "model_state_bytes", "activation_bytes"}


def plait(*args, timeout=240, **kwargs):
    return subprocess.run([sys.executable, "-m", "plait", *args], capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def plait_here(*args) -> subprocess.CompletedProcess:
    """`plait ARGS` run by the console script's own `main` in this process: its exit status and
    what this process printed. A new interpreter costs seconds of imports, and its launcher a new
    forkserver (torch imported again, ~3 s); here the workers of every run come from this test
    process's one forkserver. What the workers print is not captured (it goes where the
    forkserver's output went): tests that read it, or that set environment variables for the
    workers, run `plait` as a new process."""
    from plait.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code or 0
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def read_metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_default_recipe_trains_on_4_workers(tmp_path):
    """The default recipe, cut to 8 steps (warm-up clipped to them): 4 workers, the loss clearly
    falling (measured: 5.49 -> 3.45), validation falling between its two passes, metrics exact."""
    metrics = tmp_path / "m.jsonl"
    proc = plait("train", "--nproc", "4", "--metrics", str(metrics), "train.steps=8",
                 "train.eval_every=4", "train.eval_batches=1", "train.peak_tflops=1.0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plait train: 4 rank(s)" in proc.stdout + proc.stderr  # the summary table
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(8))
    assert all(FIELDS <= r.keys() for r in records)
    assert records[-1]["loss"] < records[0]["loss"] - 1.5
    assert records[-1]["val_loss"] < records[3]["val_loss"]
    state = records[-1]["model_state_bytes"]
    assert state["grads"] == state["params"] and state["optimizer"] == 2 * state["params"]
    # The device's peaks: none on the CPU; plait's own count beside them, on every device.
    assert all(r["gpu_mem_allocated_peak"] is None and r["gpu_mem_reserved_peak"] is None
               for r in records)
    assert records[-1]["mem_predicted_peak"] == state["peak"] + records[-1]["activation_bytes"]
    assert "peak memory predicted" in proc.stdout + proc.stderr
    # Plain data parallelism: one all-reduce of all gradients, 2 (n - 1) / n of their bytes.
    assert all(r["comm_bytes"] == 2 * 3 / 4 * state["params"] for r in records)
    assert records[-1]["tokens"] == 8 * 32 * 128


def test_dp2_tp2_sp_recipe(tmp_path):
    """The 2-D recipe, cut to 4 steps: the loss falls (measured 5.49 -> 4.17); each rank holds
    half of every split weight and all of the norms (exact bytes)."""
    from plait.model import build_model, model_args
    from plait.model.llama_plan import LLAMA

    metrics = tmp_path / "m.jsonl"
    proc = plait_here("train", "--config", "dp2_tp2_sp", "--nproc", "4", "--metrics", str(metrics),
                      "train.steps=4", "train.eval_every=0", "train.eval_batches=1",
                      "train.peak_tflops=1.0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(metrics)
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    full = build_model(model_args("small"), seed=0, device="meta")
    split = tuple(f"{p}.weight" for p in LLAMA.tp_splits if "*" not in p) + \
        ("tok_embeddings.weight", "output.weight")
    expected = sum(p.numel() * 4 // (2 if n.endswith(split) else 1)
                   for n, p in full.named_parameters())
    assert records[-1]["model_state_bytes"]["params"] == expected


def test_default_recipe_on_two_workers_and_a_short_run(tmp_path):
    """A new user's first commands: the default recipe on another number of workers (dp follows
    the world size), and a run shorter than the recipe's warm-up (clipped, said once). With no
    --nproc, one worker: test_one_worker_unless_told."""
    metrics = tmp_path / "m.jsonl"
    proc = plait_here("train", "--nproc", "2", "--metrics", str(metrics), "train.steps=3",
                      "train.eval_batches=1", "train.peak_tflops=1.0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("warm-up clipped to 3 steps") == 1  # said by the command, once
    records = read_metrics(metrics)
    # The warm-up over the 3 steps reaches the recipe's peak LR, 3e-3, at the last one.
    assert [r["lr"] for r in records] == pytest.approx([1e-3, 2e-3, 3e-3])
    assert all(r["tokens_per_s"] > 0 for r in records)  # (the summary: the 4-worker test)


def test_3d_recipe(tmp_path):
    """pp 2 x dp 2 x tp 2, ZeRO-1, interleaved, 8 ranks, cut to 4 steps: the loss falls, and the
    bytes of every step equal what the dry run predicts for rank 0 from one process."""
    metrics = tmp_path / "m.jsonl"
    proc = plait_here("train", "--config", "3d", "--nproc", "8", "--metrics", str(metrics),
                      "train.steps=4", "train.eval_every=0", "train.eval_batches=1",
                      "train.peak_tflops=1.0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(metrics)
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    from plait.cli.common import load_config, recipe_path
    from plait.config.schema import clip_warmup
    from plait.train.checks import validate
    from plait.train.dry_run import describe_rank

    cfg, _ = clip_warmup(load_config(recipe_path("3d"), ["train.steps=4"]))
    dims = validate(cfg, 8)
    assert (dims.pp, dims.dp, dims.tp) == (2, 2, 2)
    rank0 = describe_rank(cfg, dims, 0)
    assert all(r["comm_bytes"] == float(rank0["traffic"].total) for r in records)
    assert records[-1]["model_state_bytes"] == rank0["state"]


def test_moe_recipe(tmp_path):
    """8 experts, top-2, ep 2 x dp 2, cut to 8 steps: the loss falls; every step reports its
    routing (dropless: nothing dropped; the load-balancing loss near its balanced value 1); the
    summary shows it; MFU counts the activated parameters only."""
    metrics = tmp_path / "m.jsonl"
    proc = plait("train", "--config", "moe", "--nproc", "4", "--metrics", str(metrics),
                 "train.steps=8", "train.eval_every=0", "train.eval_batches=1",
                 "data.seq_len=64", "train.global_batch=8", "data.max_bytes=400000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(metrics)
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    for r in records:
        moe = r["moe"]
        assert set(moe["layers"]) == {"1", "3"}  # every other block of 4
        assert moe["dropped"] == 0.0
        assert 1.0 <= moe["aux_loss"] < 1.5
        for layer in moe["layers"].values():
            assert len(layer["load"]) == 8 and sum(layer["load"]) == 8 * 64 * 2  # top-2
            assert layer["max_load"] == pytest.approx(max(layer["load"]) / 128)
    assert "MoE busiest expert / mean (worst)" in proc.stderr
    from plait.model import build_model, count_params, model_args
    from plait.model.shape import Shape
    from plait.train.metrics import flops_per_token

    args = model_args("small-moe")
    n = count_params(build_model(args, 0, device="meta"))
    inactive = 2 * 6 * 3 * args.dim * args.ffn_dim  # 2 MoE blocks, 6 of 8 experts idle
    assert flops_per_token(Shape.of_llama(args), n, 64) == \
        6 * (n - args.vocab_size * args.dim - inactive) + 12 * args.n_layers * 64 * args.dim


def test_long_context_recipe(tmp_path):
    """The long-context recipe (ring attention over cp 4), cut to 4 steps of 2 sequences of 512
    tokens: the loss falls, and each step's communication and activations on rank 0 equal what
    `--dry-run`'s formulas say for it (128 tokens of each sequence per rank)."""
    metrics = tmp_path / "m.jsonl"
    overrides = ["train.steps=4", "train.warmup_steps=1", "train.eval_every=0",
                 "data.seq_len=512", "data.max_bytes=400000"]
    proc = plait_here("train", "--config", "long_context", "--nproc", "4", "--metrics",
                      str(metrics), *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(metrics)
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    from plait.cli.common import recipe_path
    from plait.config.schema import load_config
    from plait.train.checks import validate
    from plait.train.dry_run import describe_rank

    cfg = load_config(recipe_path("long_context"), overrides)
    dry = describe_rank(cfg, validate(cfg, 4), 0)
    assert dry["coords"]["cp"] == 0 and dry["traffic"].calls  # the shifts of the ring
    for r in records:
        assert r["comm_bytes"] == float(dry["traffic"].total)
        assert r["activation_bytes"] == dry["activations"]


def test_dry_run_prints_every_rank_and_starts_nothing():
    proc = plait_here("train", "--dry-run", "--config", "3d", "--nproc", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout.split("collectives of one training step")[0]
    rows = [line for line in table.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == [str(r) for r in range(8)]
    assert "reduce_scatter" in proc.stdout and "send" in proc.stdout
    assert "Traceback" not in proc.stderr
    bad = plait_here("train", "--dry-run", "--config", "3d", "--nproc", "6")
    assert bad.returncode == 2 and bad.stderr.startswith("plait: error: parallel")


def _strict(line: str) -> dict:
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


def test_a_non_finite_gradient_stops_the_run_at_that_step(tmp_path):
    """train.lr = 1e3: the gradient norm turns NaN at some step. The default policy stops there,
    naming the step and the likely cause, with metrics up to the step before, all strict JSON;
    'skip' goes on, dropping exactly the updates from that step on that are non-finite."""
    args = [*TINY[:5], "train.steps=8", "train.warmup_steps=1", "train.lr=1e3"]
    stop_metrics, skip_metrics = tmp_path / "stop.jsonl", tmp_path / "skip.jsonl"
    skip = plait("train", "--metrics", str(skip_metrics), *args, "train.nan_policy=skip")
    assert skip.returncode == 0, skip.stderr[-3000:]
    skipped = [_strict(line)["skipped_steps"] for line in skip_metrics.read_text().splitlines()]
    first = skipped.index(1)  # the first step whose update was dropped
    assert skipped[-1] >= 1 and "steps skipped" in skip.stderr
    stop = plait_here("train", "--metrics", str(stop_metrics), *args)  # the launcher's report
    assert stop.returncode == 1 and "plait: the job failed: rank" in stop.stderr  # its cause
    log = stop.stderr.splitlines()[-1].removeprefix("plait: every rank's traceback: ")
    assert "Traceback" in open(log).read()  # kept whole in the file the report names
    os.unlink(log)
    assert f"step {first}: the gradient norm is nan" in stop.stderr
    assert "learning rate" in stop.stderr
    lines = stop_metrics.read_text().splitlines()
    assert [_strict(line)["step"] for line in lines] == list(range(first))


def test_torchrun_runs_plait_as_its_workers(tmp_path):
    metrics = tmp_path / "m.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "plait", "train", "--metrics", str(metrics), "parallel.dp=0", *TINY],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(metrics)
    assert len(records) == 4
    assert records[-1]["comm_bytes"] == records[-1]["model_state_bytes"]["params"]  # n = 2


def test_under_torchrun_bad_input_is_said_once(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "plait", "train", "train.beta1=1.5", *TINY],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode != 0
    assert proc.stderr.count("plait: error: train.beta1") == 1


def _children(parent: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of each child of `parent` (Linux /proc), by increasing pid."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        if ppid == parent:
            found.append((int(entry), cmdline))
    return sorted(found)


def _worker_pid(parent: int, rank: int) -> int:
    """The pid of local worker `rank` under the launcher `parent`: the launcher's forkserver
    (plait.launch) forks the workers in rank order, so they are its children by increasing pid."""
    server = [pid for pid, cmdline in _children(parent) if b"forkserver" in cmdline]
    assert len(server) == 1, _children(parent)
    return [pid for pid, _ in _children(server[0])][rank]


@contextlib.contextmanager
def running_job(tmp_path, *overrides):
    """A 2-worker `plait train` started in the background, yielded once it has logged two
    steps; killed on leaving."""
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait", "train", "--nproc", "2", "--metrics", str(metrics),
         *TINY[:5], "train.steps=100000", "train.warmup_steps=1", *overrides],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        yield proc
    finally:  # the whole session: a launcher killed alone would leave its workers training
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _listening(pids: set[int]) -> list[str]:
    """Local addresses of the TCP sockets the processes `pids` listen on (Linux /proc)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address = fields[1].split(":")[0]
                if len(address) == 8:  # IPv4, little-endian hex
                    found.append(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
                else:
                    found.append("::1" if address == "0" * 24 + "01000000" else address)
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("rank", [1, 0])
def test_a_job_listens_on_loopback_only_and_names_a_stopped_rank(tmp_path, rank):
    """A running job: every socket its processes listen on is on loopback. Then SIGSTOP one rank:
    with parallel.timeout_s = 3 the other rank gives up within the timeout plus a margin, the
    job ends non-zero, and the message names the one that stopped answering. Stopped
    within a heartbeat of its start (rank 0, as soon as two steps are logged), a rank is still
    credited with the collectives the waiting rank completed with it."""
    stopped = None
    try:
        with running_job(tmp_path, "parallel.timeout_s=3") as proc:
            waiting = _worker_pid(proc.pid, rank=1 - rank)
            stopped = _worker_pid(proc.pid, rank=rank)
            addresses = _listening({proc.pid, waiting, stopped})
            os.kill(stopped, signal.SIGSTOP)
            start = time.monotonic()
            while os.path.exists(f"/proc/{waiting}") and time.monotonic() - start < 60:
                time.sleep(0.1)  # the other rank waits out the timeout, names it and fails
            elapsed = time.monotonic() - start
            # The launcher now stops the workers with SIGTERM, which a stopped process handles
            # only once continued (torch's launcher would SIGKILL it after a fixed 30 s).
            os.kill(stopped, signal.SIGCONT)
            _, err = proc.communicate(timeout=60)
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
    assert len(addresses) >= 3  # the launcher's stores and the workers' gloo connections
    assert set(addresses) <= {"127.0.0.1", "::1"}, addresses
    assert elapsed < 3 + 15, elapsed
    assert proc.returncode != 0
    assert "did not complete within parallel.timeout_s=3 s" in err
    late = f"rank(s) that did not arrive: {rank} (stopped answering"
    assert late in err
    # Stopped after its heartbeat recorded the waited collective as issued (a stop can land
    # between issuing it and sending its data), the rank is named as having issued it too.
    said = re.match(r": its last heartbeat is \d+ s old; (?:it joined this group's collectives "
                    r"up to #(\d+) |it had issued #(\d+) too)", err.split(late)[1])
    assert said, err
    joined = int(said.group(1) or said.group(2))
    assert joined >= 2 * 3, err  # two logged steps of a few all-reduces each at least
    assert "this rank's last collectives:" in err


def test_launcher_returns_results_by_rank():
    assert launch(3, workers.world_sum) == [6.0, 6.0, 6.0]


def test_the_workers_server_starts_before_the_launcher_imports_torch():
    """`plait train`'s workers are forked from a server that imports torch and the trainer (3 s
    here); started before the launcher imports torch for itself, the two imports overlap
    (`plait/forkserver.py`). The server's start is stopped here, before any worker."""
    probe = ("import multiprocessing.forkserver as f, sys\n"
             "def ensure_running():\n"
             "    print('torch' in sys.modules, f._forkserver._preload_modules)\n"
             "    sys.exit(0)\n"
             "f.ensure_running = ensure_running\n"
             "from plait import cli\n"
             "cli.main(sys.argv[1:])\n")
    proc = subprocess.run([sys.executable, "-c", probe, "train", "--nproc", "2", *TINY],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    imported, preload = proc.stdout.split(" ", 1)
    assert imported == "False"
    assert {"plait.train.run", "plait.train.trainer", "plait.launch"} <= \
        set(ast.literal_eval(preload))


def test_the_launcher_names_the_trainer_and_never_imports_it():
    """The workers' server imports the training stack; the launcher, which only waits on them,
    names their entrypoint and never imports it (2 s of CPU beside the workers on 2 cores)."""
    probe = ("import sys, plait.launch\n"
             "def launch(nproc, entrypoint, *args, **kwargs):\n"
             "    print(entrypoint, 'plait.train.run' in sys.modules, 'torch._dynamo' in "
             "sys.modules)\n"
             "    sys.exit(0)\n"
             "plait.launch.launch = launch\n"
             "from plait import cli\n"
             "cli.main(sys.argv[1:])\n")
    proc = subprocess.run([sys.executable, "-c", probe, "train", "--nproc", "2", *TINY],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["plait.train.run:run_training", "False", "False"]


def test_only_the_workers_server_ends_without_the_interpreters_teardown():
    """The server skips the interpreter's teardown at its end (`plait/forkserver.py`), told so
    by its parent's pid in the environment while it starts. No later child of that parent may
    inherit it: a process that imports the module afterwards ends with its own status."""
    forkserver.start([], 1)  # in this process, as plait_here's runs start it
    assert forkserver.SERVER not in os.environ
    code = "import sys, plait.forkserver; sys.exit(3)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 3


def test_a_failing_worker_brings_the_job_down_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(ChildFailedError) as failed:
        launch(2, workers.rank_one_fails)
    assert time.monotonic() - start < 60  # not a hang
    message = failed.value.format_msg()
    assert "rank one fails on purpose" in message and "Traceback" in message


def test_a_killed_worker_is_the_root_cause_not_the_peer_it_left_failing():
    """Rank 1 is SIGKILLed (no traceback, no error file); rank 0 then fails on the closed
    connection and writes its traceback. torch's agent reported rank 0 alone. (On a loaded
    machine the launcher's watcher may see rank 1 end only after rank 0 wrote its error, as in
    one run of two pytest workers; never after rank 0 ended: the order given the times is
    `test_the_root_cause_is_the_worker_that_ended_first_without_error`'s.)"""
    with pytest.raises(ChildFailedError) as failed:
        launch(2, workers.rank_one_is_killed)
    assert set(failed.value.failures) == {0, 1}
    root = failed.value.format_msg().split("Root Cause")[1]
    # Rank 1's record is ours ("killed by a signal") where it ended before the launcher polled
    # it, or torch's own, with the exit status the forkserver saw, where the launcher polled it
    # first ("Signal 9 (SIGKILL) received by PID ...").
    assert "rank      : 1" in root and ("killed by a signal" in root or "SIGKILL" in root), root


def test_the_root_cause_is_the_worker_that_ended_first_without_error(tmp_path):
    """The launcher's order (`launch._with_root_cause`), from the times it has: rank 1 ended with
    no error file 10 ms before rank 0 wrote one; rank 4 ended after that, but seen ended at once
    with rank 0 (its end is what made rank 0 fail: a loaded machine's watcher woke late); rank 2
    ended after rank 0 was seen ended (stopped by the agent); rank 3 returned. torch reported
    rank 0 alone."""
    import json
    import os

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from plait.launch import _with_root_cause

    attempt = tmp_path / "run" / "attempt_0"
    folders = [attempt / str(r) for r in range(5)]
    for f in folders:
        f.mkdir(parents=True)
        (f / "pid").write_text(str(os.getpid()))
    (folders[3] / "returned").write_text("")
    error = folders[0] / "error.json"
    wrote = 1_800_000_000 * 10**9  # ns; the error file says its time in whole seconds
    error.write_text(json.dumps({"message": {"message": "RuntimeError: Connection closed by "
                                             "peer", "extraInfo": {"py_callstack": "...",
                                                                   "timestamp": "1800000000"}}}))
    os.utime(error, ns=(wrote, wrote))
    seen = wrote + 3 * 10**7  # when the watcher saw rank 0 (and rank 4) ended
    ended = {folders[0]: seen, folders[1]: wrote - 10**7, folders[2]: seen + 10**8,
             folders[3]: wrote - 10**8, folders[4]: seen}
    torch_saw = ChildFailedError("fn", {0: ProcessFailure(0, 1, 1, str(error))})
    got = _with_root_cause(torch_saw, tmp_path, ended)
    assert list(got.failures) == [1, 4, 0]
    assert got.get_first_failure()[0] == 1
    assert "killed by a signal" in got.failures[1].message
    del ended[folders[1]]  # the same without rank 1: rank 4, seen after rank 0's error, is first
    assert _with_root_cause(torch_saw, tmp_path, ended).get_first_failure()[0] == 4


def test_too_little_data_is_refused_before_the_workers_start(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("too little text " * 4)
    proc = plait_here("train", "--nproc", "2", "parallel.dp=0", f"data.source={small}",
                      *TINY)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("plait: error: data.source: 64 tokens is too little")


def test_bench_comm_prints_every_collective():
    """Runs, and covers every row; no timing is asserted (timings live in the bench)."""
    proc = plait_here("bench", "comm", "--nproc", "2", "--min-seconds", "0.001")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("all_reduce (backend)", "all_reduce (ring)", "all_reduce (naive)", "all_gather",
                 "reduce_scatter", "all_to_all", "broadcast"):
        assert proc.stdout.count(name) == 6, name  # one row per size


def test_bench_gemm_writes_the_sweep_and_refuses_fp8_without_a_gpu(tmp_path):
    """On this machine's CPU: every shape measured and written (no timing asserted); fp8 is
    refused in one line where there is no GPU."""
    out = tmp_path / "gemm.json"
    proc = plait_here("bench", "gemm", "--out", str(out), "--steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["device"] == "cpu" and len(found["rows"]) == 50
    assert all(r["seconds"] > 0 and r["flops"] > 0 for r in found["rows"])
    assert "plait bench gemm: cpu" in proc.stdout
    proc = plait_here("bench", "gemm", "--out", str(out), "--fp8")
    assert proc.returncode == 2 and proc.stderr.startswith("plait: error: --fp8:")


def test_bench_step_compares_with_torch_ddp_at_each_world_size(capsys):
    """Each world size's row; the exposed communication's baseline (plait's DDP with it
    skipped) in processes of its own, beside plait's and torch's, from 2 ranks on."""
    from plait.bench.step_runs import run_step
    from plait.config.schema import load_config

    rows = run_step(2, load_config(None, list(TINY)), steps=1, repeats=1)
    out = capsys.readouterr().out
    assert "torch DDP" in out and "exposed" in out and "scaling" in out
    assert [r["ranks"] for r in rows] == [1, 2]
    assert [set(r["malloc_threshold"]) for r in rows] == \
        [{"plait", "torch"}, {"plait", "torch", "no_comm"}]
    # The baseline is plait's step, allocator included (plait/host_memory.py); torch keeps glibc's.
    assert rows[1]["malloc_threshold"]["no_comm"] == rows[1]["malloc_threshold"]["plait"] != \
        rows[1]["malloc_threshold"]["torch"]
    assert rows[1]["exposed"] is not None and rows[1]["no_comm"] > 0


@pytest.mark.parametrize("stage,peer", [(1, "ZeroRedundancyOptimizer"), (3, "fully_shard")])
def test_bench_step_zero_against_its_torch_peer(stage, peer):
    proc = plait_here("bench", "step", "--nproc", "2", "--steps", "1", "--repeats", "1",
                      f"parallel.zero={stage}", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert peer in proc.stdout and f"ZeRO-{stage}" in proc.stdout


def test_bench_step_with_muon_compares_its_owners_with_everyone_orthogonalizing():
    proc = plait_here("bench", "step", "--nproc", "2", "--steps", "1", "--repeats", "1",
                      "train.optimizer=muon", "parallel.zero=3", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == [
        "each matrix once, by its owner (plait)",
        "every rank gathers and orthogonalizes every matrix"]
    assert "Muon: dp 2 x tp 1, ZeRO-3" in proc.stdout


def test_bench_step_runs_each_side_in_processes_of_its_own():
    """plait's trainer sets glibc's mmap threshold for its whole process (1 MiB, then glibc's 32
    MiB ceiling after the first step: plait/host_memory.py); torch's fully_shard, launched
    apart, keeps glibc's own, as a user of torch alone has it."""
    from plait.bench.step_runs import run_step
    from plait.config.schema import load_config
    from plait.host_memory import STEADY_THRESHOLD

    cfg = load_config(None, ["parallel.zero=3", *TINY])
    rows = run_step(2, cfg, steps=1, repeats=1)
    assert [r["malloc_threshold"] for r in rows] == \
        [{"plait": STEADY_THRESHOLD, "torch": None}] * 2
    # The pipeline composition's bench too: its plait side builds a ZeRO-3 row beside ZeRO-1.
    cfg = load_config(None, ["parallel.pp=2", "parallel.zero=1", "model.n_layers=2", *TINY])
    rows = run_step(2, cfg, steps=1, repeats=1)
    assert [r["variant"] for r in rows][1] == "plait ZeRO-3"
    assert {r["malloc_threshold"]["torch"] for r in rows} == {None}


def test_bench_step_tensor_parallel_against_dtensor():
    proc = plait_here("bench", "step", "--nproc", "2", "--steps", "1", "--repeats", "1",
                      "parallel.tp=2", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for variant in ("plait TP", "plait TP + sequence parallel", "torch DTensor TP"):
        assert variant in proc.stdout, variant
    bad = plait_here("bench", "step", "--nproc", "4", "parallel.tp=2", *TINY)
    assert bad.returncode == 2 and bad.stderr.startswith("plait: error: --nproc")


def test_bench_step_3d_against_torchs_composition():
    proc = plait("bench", "step", "--nproc", "4", "--steps", "1", "--repeats", "1", "parallel.pp=2",
                 "parallel.tp=2", "parallel.zero=1", "model.n_layers=4", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for variant in ("plait ZeRO-1", "plait ZeRO-3", "torch pipelining + parallelize_module"):
        assert variant in proc.stdout, variant
    assert "Warning" not in proc.stderr
    bad = plait_here("bench", "step", "--nproc", "4", "parallel.pp=2",
                     "parallel.pp_schedule=zb1", *TINY)
    assert bad.returncode == 2 and "parallel.pp_schedule" in bad.stderr


def test_bench_pp_tables_every_schedule_and_draws_the_timeline(tmp_path):
    png = tmp_path / "timeline.png"
    proc = plait_here("bench", "pp", "--nproc", "2", "--steps", "1", "--png", str(png),
                      "model.n_layers=4", "parallel.microbatches=4", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("│")[1].strip(): line for line in proc.stdout.splitlines()
            if line.startswith("│")}
    assert set(rows) == {"gpipe", "1f1b", "interleaved", "zb1"}
    # Simulated and closed-form bubbles printed side by side agree (2 stages, 4 micro-batches).
    assert [c.strip() for c in rows["1f1b"].split("│")[2:4]] == ["0.200", "0.200"]
    # Each schedule's measured bubble explained: the step's own costs replayed, then the rest.
    for name in rows:
        assert f"{name}: formula " in proc.stdout and "replayed with free messages" in proc.stdout
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_bench_moe_tables_each_degree_and_draws_the_load(tmp_path):
    png = tmp_path / "load.png"
    proc = plait_here("bench", "moe", "--nproc", "2", "--ep", "1,2", "--steps", "1", "--warmup",
                      "0", "--png", str(png), *TINY, "model.preset='tiny-moe'")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("│")}
    assert set(rows) == {"1", "2"}
    assert rows["1"][2] == "1.00"  # the loop against itself
    assert rows["1"][5] == "-"  # no all-to-all without expert parallelism
    assert rows["2"][5] != "-" and rows["2"][6] == rows["1"][6] == "0.0%"  # dropless
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_bench_compression_tables_each_method_and_the_torch_hooks(tmp_path):
    png = tmp_path / "loss.png"
    proc = plait_here("bench", "compression", "--nproc", "2", "--methods", "none,int8,topk",
                      "--png", str(png), *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("│")}
    assert set(rows) == {"none", "int8", "topk", "torch fp16_compress_hook",
                         "torch powerSGD_hook"}
    assert rows["none"][4] == "1.000"  # bytes ratio
    assert 0 < float(rows["topk"][4]) < float(rows["int8"][4]) < 0.5
    assert rows["torch powerSGD_hook"][3] == "-"  # torch's bytes are not in plait's ledger
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_bench_compression_refuses_an_unknown_method():
    proc = plait_here("bench", "compression", "--methods", "none,zip")
    assert proc.returncode == 2 and proc.stderr.startswith("plait: error: --methods")


def _metrics(path, losses):
    path.write_text("".join(json.dumps({"step": i, "loss": x}) + "\n"
                            for i, x in enumerate(losses)))
    return str(path)


def test_compare_names_the_first_step_beyond_tolerance(tmp_path):
    a = _metrics(tmp_path / "a.jsonl", [5.0, 4.0, 3.0, 2.5])
    same = _metrics(tmp_path / "same.jsonl", [5.0, 4.0 * (1 + 1e-7), 3.0, 2.5])
    off = _metrics(tmp_path / "off.jsonl", [5.0, 4.0, 3.01, 2.6])
    short = _metrics(tmp_path / "short.jsonl", [5.0, 4.0])
    nan = _metrics(tmp_path / "nan.jsonl", [5.0, None, 3.0, 2.5])  # a run's null: not finite
    assert plait_here("compare", a, same).returncode == 0
    proc = plait_here("compare", a, off)
    assert proc.returncode == 1 and proc.stdout.startswith("step 2: loss 3.0 vs 3.01"), proc.stdout
    assert plait_here("compare", a, off, "--rtol", "0.05").returncode == 0
    proc = plait_here("compare", a, short)
    assert proc.returncode == 0 and "2 step(s) only in" in proc.stdout
    assert plait_here("compare", a, nan).returncode == 1
    (tmp_path / "bad.jsonl").write_text("not json\n")
    for args in ([a, str(tmp_path / "missing.jsonl")], [a, str(tmp_path / "bad.jsonl")],
                 [a, a, "--rtol", "-1"]):
        proc = plait_here("compare", *args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """The tiny model 4 steps on 1 worker (no --nproc), with TMPDIR an empty folder, and on 2
    workers, with TensorBoard: what the compare, TensorBoard, temporary-folder and default-world
    tests read."""
    root = tmp_path_factory.mktemp("tiny")
    (root / "tmp").mkdir()
    one = plait("train", "--metrics", str(root / "one.jsonl"), *TINY,
                env={**os.environ, "TMPDIR": str(root / "tmp")})
    assert one.returncode == 0, one.stderr[-3000:]
    (root / "one.out").write_text(one.stdout + one.stderr)
    two = plait_here("train", "--nproc", "2", "--metrics", str(root / "two.jsonl"), "--tensorboard",
                     str(root / "tb"), *TINY)
    assert two.returncode == 0, two.stderr[-3000:]
    return root


def test_one_worker_unless_told(tiny_runs):
    assert "plait train: 1 rank(s)" in (tiny_runs / "one.out").read_text()


def test_compare_two_layouts_of_one_run(tiny_runs):
    """What the equivalence tests check, by the user's hand: 1 and 2 data-parallel ranks; and
    both runs' curves in one picture."""
    png = tiny_runs / "curves" / "both.png"
    proc = plait_here("compare", tiny_runs / "one.jsonl", tiny_runs / "two.jsonl", "--png", png)
    assert proc.returncode == 0 and proc.stdout.startswith(f"wrote {png}"), proc.stdout
    assert "4 steps agree" in proc.stdout
    assert png.read_bytes().startswith(b"\x89PNG")


def test_a_run_leaves_no_temporary_folder(tiny_runs):
    # Nothing per launch (torch's own inductor cache, one folder shared by every run, may be
    # created on import and stays, as a cache does).
    left = [p.name for p in (tiny_runs / "tmp").iterdir()
            if not p.name.startswith("torchinductor_")]
    assert left == []


def test_tensorboard_gets_every_metric_as_a_scalar(tiny_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tiny_runs / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "lr", "mfu", "comm_bytes", "model_state_bytes/params", "val_loss"} <= tags
    rows = read_metrics(tiny_runs / "two.jsonl")
    assert [e.step for e in events.Scalars("loss")] == [r["step"] for r in rows]
    for event, row in zip(events.Scalars("loss"), rows, strict=True):
        assert event.value == pytest.approx(row["loss"], rel=1e-6)  # stored as float32


def _png(path):
    return path.stat().st_size > 5_000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    """pp 2 x dp 2 (1F1B), 4 steps, the metrics and a trace of steps 1 and 2."""
    root = tmp_path_factory.mktemp("traced")
    metrics, out = root / "metrics.jsonl", root / "trace"
    proc = plait_here("train", "--nproc", "4", "--metrics", str(metrics), "--trace", str(out),
                      "--trace-steps", "2", "parallel.pp=2", "parallel.microbatches=2", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def test_pipeline_through_the_cli(traced_run):
    """2 stages x 2 replicas, 1F1B: the loss (computed on the last stage) reaches rank 0's
    metrics and falls (measured 5.62 -> 4.91 in 4 steps); the step sends, receives and
    all-reduces."""
    records = read_metrics(traced_run / "metrics.jsonl")
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert records[0]["comm_calls"].keys() >= {"send", "recv", "all_reduce"}


def test_trace_holds_each_ranks_actions_and_collectives(traced_run):
    """Every rank's trace loads as JSON and holds the traced steps' pipeline actions; each
    collective is on one of the rank's mesh groups, and rank 0's add up to the step's
    comm_bytes in the metrics (the ledger and the trace see the same collectives)."""
    from plait.mesh import ParallelDims
    from plait.train.tracing import _by_step

    dims, out = ParallelDims(pp=2, dp=2), traced_run / "trace"
    rows = read_metrics(traced_run / "metrics.jsonl")
    for rank in range(4):
        trace = json.loads((out / f"rank{rank}.json").read_text())
        assert trace["otherData"]["coords"] == dims.coords(rank)
        by_step = _by_step(trace["traceEvents"])
        assert sorted(by_step) == [1, 2]
        groups = {tuple(dims.group_ranks(axis, rank)) for axis in ("pp", "dp")}
        for step, events in by_step.items():
            actions = sorted((e["args"]["kind"], e["args"]["microbatch"]) for e in events
                             if e.get("cat") == "pipeline")
            assert actions == [("B", 0), ("B", 1), ("F", 0), ("F", 1)]
            collectives = [e for e in events if e.get("cat") == "collective" and e["ph"] in "Xb"]
            assert collectives and {tuple(e["args"]["ranks"]) for e in collectives} <= groups
            if rank == 0:
                moved = sum(e["args"]["bus_bytes"] for e in collectives)
                assert moved == rows[step]["comm_bytes"]
    merged = json.loads((out / "trace.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1, 2, 3}
    assert _png(out / "pipeline.png")


def test_report_draws_a_run_and_says_what_it_left_out(traced_run, tmp_path):
    proc = plait_here("report", str(traced_run), "--out", str(tmp_path / "all"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("loss", "throughput", "comm", "memory"):
        assert _png(tmp_path / "all" / f"{name}.png"), name
    losses_only = _metrics(tmp_path / "losses.jsonl", [5.0, 4.0, 3.0])
    proc = plait_here("report", losses_only)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _png(tmp_path / "report" / "loss.png")  # default: report/ beside the file
    assert proc.stdout.count("note: left out") == 3
    assert not (tmp_path / "report" / "comm.png").exists()


def test_bench_plan_measures_what_a_plan_predicts():
    """`plait bench plan`'s measurement of one row (ZeRO-1 dp2, the tiny model): rank 0's model
    state at the end of the step, bytes communicated and activations equal the plan's, as its
    table reports them ("peak", the state's high point during the step, is not part of it)."""
    from plait.bench.planner import measure_run, predicted
    from plait.config.schema import load_config
    from plait.planner.hardware import DEVICES

    cfg = load_config(None, [*TINY, "parallel.zero=1"])
    measured = launch(2, measure_run, cfg, 1)[0]
    plan = predicted(cfg, 2, DEVICES["h100"])
    assert {k: measured[k] for k in ("state", "comm", "activations")} == \
        {k: plan[k] for k in ("state", "comm", "activations")}


def test_bench_scaling_tables_speedup_and_efficiency(tmp_path):
    png = tmp_path / "speedup.png"
    proc = plait_here("bench", "scaling", "--nproc", "1,2", "--weak", "--steps", "1", "--png",
                      str(png), *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("│")}
    assert set(rows) == {"1", "2"}
    assert [rows["1"][0], rows["2"][0]] == ["8", "16"]  # weak: the batch grows with the ranks
    assert rows["1"][2:5] == ["1.00", "100%", "0.0%"]  # speedup, efficiency, exposed at 1 rank
    assert rows["1"][6:8] == ["1.00", "100%"]  # torch DDP ran beside it
    speedup, efficiency = float(rows["2"][2]), float(rows["2"][3].rstrip("%")) / 100
    assert efficiency == pytest.approx(speedup / 2, abs=0.006)  # both printed rounded
    assert ("contention" in proc.stderr) == (2 > os.cpu_count())
    assert _png(png)


def test_plan_predicts_the_runs_bytes(traced_run):
    """DESIGN's contract: for a configuration that runs, the plan's memory and communication
    equal the run's model_state_bytes, activation_bytes and comm_bytes (rank 0)."""
    pins = ["parallel.pp=2", "parallel.tp=1", "parallel.zero=0", "parallel.dp_shard=0",
            "parallel.microbatches=2", "parallel.pp_schedule=1f1b",
            "parallel.sequence_parallel=false", "train.activation_checkpointing=none"]
    proc = plait_here("plan", "--gpus", "4", "--gpu", "cpu", "--json", *pins, *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plans = json.loads(proc.stdout)
    assert len(plans) == 1  # every degree pinned: that plan alone
    plan, last = plans[0], read_metrics(traced_run / "metrics.jsonl")[-1]
    assert {k: plan["memory_bytes"][k] for k in ("params", "grads", "optimizer", "peak")} == \
        last["model_state_bytes"]
    assert plan["memory_bytes"]["activations"] == last["activation_bytes"]
    assert plan["comm_bytes"] == last["comm_bytes"]
    for key in ("dp", "tp", "pp", "zero", "microbatches", "step_time_s", "tokens_per_s", "mfu",
                "bubble", "warnings", "params"):
        assert key in plan, key


def test_verify_runs_zero3_outside_the_trainers_step():
    """`plait train --verify` under ZeRO-3 (dp2 x pp2, with document masks): a unit regathered
    for backward keeps the version counter its forward saved the parameters at (gloo counts its
    writes when a transfer completes); before, autograd refused the saved head weight here, and
    only the trainer's step (whose saved tensors go through the activation count's hooks) ran."""
    proc = plait_here("train", "--verify", "--nproc", "4", "parallel.zero=3", "parallel.pp=2",
                      "data.document_mask=true", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("verify: ok"), proc.stdout


@pytest.mark.parametrize("zero", [1, 3])
def test_verify_in_bf16_under_zero_holds_the_reference_as_the_layout_holds_its_own(zero):
    """`--verify train.precision=bf16` under ZeRO, whose parameters are then held in bf16
    (`train.param_dtype=auto`): the one-process reference holds its parameters in bf16 too, and
    every group is within the half precisions' 2e-2. Against an fp32 reference under autocast
    the embedding's gradient was 0.12 of its largest off (DDP, fp32-held: 1e-6)."""
    proc = plait_here("train", "--verify", "--nproc", "2", f"parallel.zero={zero}",
                      "train.precision=bf16", *TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("verify: ok"), proc.stdout


def test_bench_gpu_times_plait_and_the_plain_loop_each_in_its_own_process(tmp_path):
    """`plait bench gpu` at its tiny shape on the CPU (compiled sides through "aot_eager": the
    whole of torch.compile's front end without generating code): every side's step, rates and
    peak memory, and the ratios that the GPU issue reads. No timing is asserted."""
    out = tmp_path / "gpu.json"
    proc = plait("bench", "gpu", "--shape", "tiny", "--steps", "2", "--warmup", "2",
                 "--compile-backend", "aot_eager", "--json", str(out), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert set(got["sides"]) == {"plait", "plait-compiled", "plait-hf", "loop", "loop-compiled"}
    tokens = 8 * 32
    for side, r in got["sides"].items():
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_s"]), side
        assert r["mfu"] > 0 and r["memory"]["allocated"] > 0, side
        assert r["memory"]["reserved"] is None, side  # the CPU keeps no reserved pool
        assert r["microbatches"] == 1, side
    assert set(got["ratios"]) == {"plait-compiled / loop-compiled", "plait-hf / loop-compiled",
                                  "plait / loop"}
    assert "plait-compiled / loop-compiled" in proc.stdout


def test_bench_gpu_refuses_the_1b_shape_without_a_gpu():
    proc = plait("bench", "gpu", "--shape", "1b")
    assert proc.returncode == 2 and "--shape" in proc.stderr and "tiny" in proc.stderr
