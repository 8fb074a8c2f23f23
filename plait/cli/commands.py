"""The commands that train and run (train, run), and those that start no worker (plan, compare,
report, convert): each `cmd_*` takes the parsed arguments, checks every input it can (status 2
and one line, `ConfigError`), then launches or answers. The parser and dispatch: __init__.py."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import socket
import sys
from pathlib import Path

from plait import forkserver
from plait.checkpoint import BadMeta, complete_checkpoints, find
from plait.checkpoint.hf_llama import model_overrides, names_problem
from plait.cli.common import check_output_path, in_torchrun, load
from plait.config.checks_hf import check_hf_folder, check_safetensors
from plait.config.schema import AXES, Config, ConfigError, model_section
from plait.data.checks import check_data
from plait.mesh import TP_ACROSS, across_nodes, ranks_per_node
from plait.planner.hardware import ENGINES, Cluster, check_options, device, planned_precision
from plait.planner.pins import check_mesh_pins, pinned
from plait.train.checks import validate
from plait.train.compare import MetricsFileError, compare_losses
from plait.train.elastic import fit_world
from plait.train.outputs import Outputs
from plait.train.report import draw_losses, write_report


def default_world(cfg: Config) -> int:
    """World size implied by the degrees: their product, with an unset dp counting as 1."""
    return math.prod(getattr(cfg.parallel, a) or 1 for a in AXES)


def outputs(args: argparse.Namespace):
    return Outputs(args.metrics, args.tensorboard, args.trace, args.trace_steps)


def check_inputs(cfg: Config, out=None) -> None:
    """What validate cannot see from the configuration alone: the data and the output paths."""
    # here, not at the top: the command line's refusals import no torch
    from plait.data.mixture import check_corpus

    vocab_key = f"model.hf ({cfg.model.hf})" if cfg.model.hf else "model.vocab_size"
    note = check_corpus(cfg.data, cfg.model.args().vocab_size, cfg.train.global_batch, vocab_key)
    if note and speaks():
        print(note, file=sys.stderr)
    if out is None:
        return
    if out.metrics is not None:
        check_output_path(out.metrics)
    if out.tensorboard is not None:
        check_output_path(out.tensorboard, "--tensorboard", folder=True)
    if out.trace is not None:
        check_output_path(out.trace, "--trace", folder=True)
        if out.trace_steps < 1:
            raise ConfigError("--trace-steps", f"at least 1 step, got {out.trace_steps}")


def speaks() -> bool:
    """Whether this process reports to the user: always, except under torchrun, where every
    worker runs the same checks and rank 0 alone says what they find."""
    return not in_torchrun() or os.environ.get("RANK", "0") == "0"


def fit_to_world(cfg: Config, world: int, say: bool = True) -> Config:
    """A resume on another world size: what changes to keep the run (train/elastic.py), said."""

    cfg, notes = fit_world(cfg, world)
    for note in notes if say else ():
        print(f"plait: note: {note}", file=sys.stderr)
    return cfg


def cmd_train(args: argparse.Namespace) -> None:
    cfg = load(args, say=speaks())
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts", f"a count >= 0, got {args.max_restarts}")
    if in_torchrun():  # we are one of torchrun's workers
        _train_as_torchrun_worker(args, cfg)
        return
    nproc = default_world(cfg) if args.nproc is None else args.nproc
    nodes = _nodes(args)
    if nodes and args.nproc is None:
        raise ConfigError("--nproc", "a multi-node job needs --nproc, the workers per node")
    if args.max_restarts and not cfg.checkpoint.dir:
        print("plait: note: --max-restarts without checkpoint.dir: a restarted job begins again "
              "at step 0", file=sys.stderr)
    if nodes and not cfg.parallel.ranks_per_node:  # what the checks and --dry-run see
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                    ranks_per_node=nproc))

    cfg = fit_to_world(cfg, nproc * (nodes or 1))
    dims = validate(cfg, nproc * (nodes or 1))
    check_inputs(cfg, None if args.dry_run else outputs(args))
    if nodes and not args.dry_run:
        _exec_torchrun(args, nproc)
    if args.dry_run:
        # here, not at the top: the command line's refusals import no torch
        from plait.train.dry_run import print_dry_run

        print_dry_run(cfg, dims)
        return
    _launch_local(args, cfg, nproc)


def _train_as_torchrun_worker(args: argparse.Namespace, cfg: Config) -> None:
    """One of torchrun's workers: checked for the world torchrun made, then trained in this
    process (rank 0 alone writes the metrics and TensorBoard; every rank its trace)."""
    if args.nproc is not None:
        raise ConfigError("--nproc", "torchrun starts the workers; drop --nproc under torchrun")
    if args.max_restarts:
        raise ConfigError("--max-restarts", "under torchrun, give torchrun --max-restarts")
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) and \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ConfigError("--max-restarts", "torchrun's shared store keeps a dead attempt's "
                          "keys, which hang the restart (pytorch#135712): run torchrun with "
                          "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")

    cfg = fit_to_world(cfg, int(os.environ["WORLD_SIZE"]), speaks())
    dims = validate(cfg, int(os.environ["WORLD_SIZE"]))

    node = ranks_per_node(cfg.parallel.ranks_per_node, dims.world_size)
    if "tp" in across_nodes(dims, node) and speaks():
        print(f"plait: warning: {TP_ACROSS}", file=sys.stderr)
    out = outputs(args)
    if not speaks():
        out = dataclasses.replace(out, metrics=None, tensorboard=None)
    check_inputs(cfg, out)
    # here, not at the top: the command line's refusals import no torch
    from plait.train.run import run_training

    verdict = run_training(cfg, out, args.verify)
    if args.verify:
        _verdict(verdict, speaks())


def _launch_local(args: argparse.Namespace, cfg: Config, nproc: int) -> None:
    """`--nproc N` local workers through the elastic launcher; a failure ends this process with
    status 1 and the workers' report (the first to fail as the cause)."""
    # The workers' server imports their stack while this process imports torch for itself.
    stack = [*forkserver.TRAINING, *(forkserver.HF if cfg.model.hf else ())]
    forkserver.start(stack, cfg.train.threads)
    # here, not at the top: the command line's refusals import no torch
    from plait.launch import ChildFailedError, launch, report

    try:  # the trainer by name: this process never imports it
        results = launch(nproc, "plait.train.run:run_training", cfg, outputs(args), args.verify,
                         threads=cfg.train.threads, max_restarts=args.max_restarts,
                         preload=stack)
    except ChildFailedError as e:
        print(report(e, _kept(cfg)), file=sys.stderr)
        sys.exit(1)
    if args.verify:
        _verdict(results[0], True)


def _nodes(args: argparse.Namespace) -> int:
    """The most nodes --nnodes allows (0: a one-node job), --rdzv-endpoint checked with it."""
    if not (args.nnodes or args.rdzv_endpoint or args.local_addr):
        return 0
    if args.nnodes is None:
        given = "--rdzv-endpoint" if args.rdzv_endpoint else "--local-addr"
        raise ConfigError("--nnodes", f"{given} is for a job across nodes: give --nnodes N (or "
                          "MIN:MAX) and --rdzv-endpoint HOST:PORT with it")
    low, _, high = args.nnodes.partition(":")
    if not (low.isdigit() and (high or low).isdigit() and 1 <= int(low) <= int(high or low)):
        raise ConfigError("--nnodes", f"N or MIN:MAX nodes (2, 1:2), got {args.nnodes!r}")
    host, _, port = (args.rdzv_endpoint or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError("--rdzv-endpoint", f"HOST:PORT of the rendezvous (on one of the job's "
                          f"nodes), got {args.rdzv_endpoint!r}")
    try:  # torchrun would retry an unknown name for minutes, then end in a traceback
        socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise ConfigError("--rdzv-endpoint", f"host {host!r} does not resolve here "
                          f"({getattr(e, 'strerror', None) or e}); name a node by an address or "
                          "a name this machine resolves") from None
    return int(high or low)


def _exec_torchrun(args: argparse.Namespace, nproc: int) -> None:
    """Become this node's torchrun (the job checked): `plait train` on its workers, a c10d
    rendezvous hosted by the node whose address the endpoint names (torchrun's own test compares
    host names, which nodes can share: plait binds the address to see whether it is this
    machine's)."""
    host = args.rdzv_endpoint.rpartition(":")[0]
    with socket.socket() as probe:
        try:
            probe.bind((host, 0))
            is_host = "true"
        except OSError:
            is_host = "false"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", args.nnodes,
            "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-conf", f"is_host={is_host}",
            "--max-restarts", str(args.max_restarts),
            *(["--local-addr", args.local_addr] if args.local_addr else []),
            "-m", "plait", "train"]
    for flag, value in (("--config", args.config), ("--metrics", args.metrics),
                        ("--tensorboard", args.tensorboard), ("--trace", args.trace)):
        argv += [flag, str(value)] if value is not None else []
    argv += ["--trace-steps", str(args.trace_steps)] if args.trace else []
    argv += ["--verify"] if args.verify else []
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # see the check above
    sys.stdout.flush()
    os.execve(sys.executable, [*argv, *args.overrides], env)


def _verdict(verdict, say: bool) -> None:
    """Print `plait train --verify`'s table; exit 1 when a difference is beyond tolerance."""
    if say:
        print(verdict.table())
    if verdict.failures():
        sys.exit(1)


def cmd_run(args: argparse.Namespace) -> None:
    # here, not at the top: the command line's refusals import no torch
    from plait.launch import ChildFailedError, launch_script, report

    if args.nproc < 1:
        raise ConfigError("--nproc", f"need at least one process, got {args.nproc}")
    if args.threads < 1:
        raise ConfigError("--threads", f"at least 1, got {args.threads}")
    if not Path(args.script).is_file():
        raise ConfigError("script", f"{args.script} is not a file; give the path of a .py file")

    for module in args.preload:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            raise ConfigError("--preload", f"no module {module} here; install it or drop it")
    try:
        launch_script(args.nproc, args.script, args.args, args.threads, args.preload)
    except ChildFailedError as e:
        print(report(e), file=sys.stderr)
        sys.exit(1)


def _kept(cfg: Config) -> str:
    """What a failed run left to resume from: its last complete checkpoint, if it saves any."""
    if not cfg.checkpoint.dir:
        return ""

    saved = complete_checkpoints(cfg.checkpoint.dir)
    if not saved:
        return f"no complete checkpoint in {cfg.checkpoint.dir}"
    return (f"the last complete checkpoint: {saved[-1]} (checkpoint.resume = 'auto', the "
            "default, resumes from it)")


def cmd_compare(args: argparse.Namespace) -> None:
    if not args.rtol >= 0:
        raise ConfigError("--rtol", f"a relative tolerance >= 0, got {args.rtol}")
    if args.png is not None:
        check_output_path(args.png, "--png")
    try:
        result = compare_losses(args.a, args.b, args.rtol)
    except MetricsFileError as e:
        raise ConfigError("compare", str(e)) from None
    if args.png is not None:

        print(f"wrote {draw_losses([args.a, args.b], args.png)}")
    for path, extra in result.only_in.items():
        if extra:
            print(f"note: {extra} step(s) only in {path}; compared the {result.steps} both have")
    if result.first_bad is not None:
        step, a, b, rel = result.first_bad
        print(f"step {step}: loss {a} vs {b}, relative difference {rel:.3g} > rtol {args.rtol}")
        sys.exit(1)
    print(f"{result.steps} steps agree within rtol {args.rtol} (largest relative difference "
          f"{result.worst:.3g})")


def cmd_plan(args: argparse.Namespace) -> None:
    if args.calibrate:
        # here, not at the top: the command line's refusals import no torch
        from plait.bench.calibrate import calibrate_and_print

        calibrate_and_print()
        return
    check_options(args)
    if args.write_recipe is not None:
        check_output_path(args.write_recipe, "--write-recipe")
    cfg = load(args)
    if cfg.model.hf:
        check_hf_folder(cfg.model.hf)
    fixed = pinned(cfg, args.overrides)
    check_mesh_pins(fixed, args.gpus)
    # here, not at the top: the command line's refusals import no torch
    from plait.planner.policy import choose
    from plait.planner.show import as_json, print_plans, write_recipe

    cluster = Cluster(args.gpus, args.gpus_per_node,
                      device(args.gpu, args.intra_node_gbps, args.inter_node_gbps, args.gpus,
                             args.gpu_memory_gb, args.gpu_tflops), ENGINES[args.engine])
    cfg, cluster = planned_precision(cfg, cluster)
    plans = choose(cfg, cluster, fixed)
    check_data(cfg.data, cfg.model.args())  # the corpus, the same for every layout
    if args.json:
        print(as_json(plans, args.top))
    else:
        print_plans(plans, cluster, args.top, plans[0].params)
    if args.write_recipe:
        write_recipe(args.write_recipe, cfg, plans[0], cluster)
    if not plans[0].fits:  # every degree pinned: priced and shown, and it does not fit
        sys.exit(1)


def cmd_report(args: argparse.Namespace) -> None:
    if args.out is not None:
        check_output_path(args.out, "--out", folder=True)
    try:
        written, missing = write_report(args.metrics, args.out)
    except MetricsFileError as e:
        raise ConfigError("report", str(e)) from None
    for note in missing:
        print(f"note: left out {note}")
    for path in written:
        print(path)


def cmd_convert(args: argparse.Namespace) -> None:
    if args.to:  # plait convert --to hf OUT CKPT
        out, source = args.first, find(args.second, "")
        if source is None:
            raise ConfigError("CKPT", f"no complete checkpoint at {args.second}; give a "
                              "checkpoint folder (with COMPLETE) or a folder of them")
        check_output_path(out, "OUT", folder=True)
        # here, not at the top: safetensors only for a Hugging Face folder
        from plait.checkpoint.hf import export_hf
        from plait.checkpoint.metadata import UnsafeCheckpoint, check_checkpoint

        try:
            saved = check_checkpoint(source)
        except (UnsafeCheckpoint, BadMeta) as e:
            raise ConfigError("CKPT", f"{e}; convert a checkpoint you trust") from None

        if "hf" in saved and not (Path(saved["hf"]) / "config.json").is_file():
            raise ConfigError("CKPT", f"{source} was trained from the Hugging Face folder "
                              f"{saved['hf']}, whose config.json is gone; restore the folder")
        if "hf" not in saved and model_section(saved).args().moe_experts:
            raise ConfigError("CKPT", f"{source} is a mixture of experts, which a Hugging Face "
                              "Llama folder cannot hold; export a dense model")
        print(export_hf(source, out))
    else:  # plait convert --from hf HF_DIR OUT_CKPT
        _convert_from_hf(Path(args.first), args.second)


def _convert_from_hf(hf: Path, out: str) -> None:
    """The folder's config.json and tensor names are checked without torch (a refusal takes a
    fraction of a second), their shapes against plait's Llama once torch is imported."""
    if not (hf / "config.json").is_file() or not any(hf.glob("*.safetensors")):
        raise ConfigError("HF_DIR", f"{hf} holds no config.json and *.safetensors; give a "
                          "Hugging Face Llama folder")
    check_output_path(out, "OUT_CKPT", folder=True)

    try:
        raw = json.loads((hf / "config.json").read_text())
    except ValueError as e:
        raise ConfigError("HF_DIR", f"{hf}/config.json: {e}".splitlines()[0]) from None
    if not isinstance(raw, dict):
        raise ConfigError("HF_DIR", f"{hf}/config.json holds no JSON object")
    names = check_safetensors(hf, "HF_DIR")
    try:
        model_overrides(raw)  # what plait's Llama cannot represent, or a setting missing
    except KeyError as e:
        raise ConfigError("HF_DIR", f"{hf}/config.json lacks {e}, which a Llama's config has; "
                          "give a whole Hugging Face Llama folder") from None
    except (ValueError, TypeError) as e:
        raise ConfigError("HF_DIR", f"{hf}/config.json: {str(e).split(';')[0]}; train the "
                          f"folder as itself instead: plait train model.hf={hf}") from None
    problem = names_problem(names, raw)
    if problem:
        raise ConfigError("HF_DIR", f"{hf}: {problem}; give a Hugging Face Llama folder")
    # here, not at the top: safetensors only for a Hugging Face folder
    from plait.checkpoint.hf import import_hf  # torch, from here on

    try:
        path, overrides = import_hf(hf, out)
    except ValueError as e:  # a tensor of another shape
        raise ConfigError("HF_DIR", f"{e}; give a Hugging Face Llama folder") from None
    settings = " ".join(f"model.{k}={v}" for k, v in overrides.items())
    print(f"{path}\ncontinue training it with: plait train checkpoint.resume={path} {settings}")
