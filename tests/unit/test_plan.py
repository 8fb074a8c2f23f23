"""The planner prices layouts with the engine's own formulas (what the composition matrix asserts
equal to real runs), so its bytes equal `--dry-run`'s; it flags each anti-pattern; it reproduces
the ZeRO paper's model-state table. The end-to-end check against a real run's metrics is in
tests/e2e/test_cli.py."""

from __future__ import annotations

import dataclasses

import pytest
from training import tiny_config

from plait.config.schema import ConfigError, load_config
from plait.model import build_model
from plait.planner.hardware import DEVICES, Cluster, Device
from plait.planner.policy import PIPELINE_SAVES, choose, leanest
from plait.planner.price import estimate, with_degrees
from plait.planner.search import rank_plans, ranked, warnings
from plait.predict.cost import all_to_all_bytes
from plait.train.checks import validate
from plait.train.dry_run import describe_rank

# A made-up device with round numbers, so no test measures this machine.
TOY = Device("toy", peak_flops=1e12, memory_bytes=1e9, intra_gbps=10, inter_gbps=1)


@pytest.mark.parametrize("overrides,gpus", [
    ([], 2), (["parallel.zero=1"], 4), (["parallel.zero=3", "parallel.dp_shard=2"], 4),
    (["parallel.tp=2", "parallel.sequence_parallel=true"], 4),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.zero=2"], 4),
    (["parallel.pp=2", "parallel.tp=2", "train.activation_checkpointing=full",
      "train.precision=bf16", "parallel.zero=3"], 8),
    (["parallel.cp=2", "parallel.tp=2", "parallel.zero=3"], 8),
    (["parallel.cp=4", "parallel.cp_method=ulysses", "train.activation_checkpointing=selective"],
     4),
    (["parallel.pp=3", "parallel.microbatches=4"], 3),  # 4 layers on 3 stages: uneven
])
def test_a_plan_prices_bytes_as_the_dry_run_does(overrides, gpus):
    cfg = tiny_config("model.n_layers=4", *overrides)
    dims = validate(cfg, gpus)
    plan = estimate(cfg, dims, Cluster(gpus, 8, TOY))
    rank0 = describe_rank(cfg, dims, 0)
    assert plan.memory_bytes == {**{k: rank0["state"][k]
                                    for k in ("params", "grads", "optimizer", "peak")},
                                 "activations": rank0["activations"],
                                 "total": sum(rank0["state"].values()) - rank0["state"]["peak"]
                                 + rank0["activations"]}
    assert plan.comm_bytes == float(rank0["traffic"].total)
    # What must fit: the worst rank's peak model state during the step (ZeRO's gathered units
    # and gradient staging at their most) plus its activations.
    worst = max(r["state"]["peak"] + r["activations"]
                for r in (describe_rank(cfg, dims, k) for k in range(gpus)))
    assert plan.peak_memory_bytes == max(worst, plan.startup_bytes)  # or building it, if more
    assert 0 < plan.mfu <= TOY.efficiency and plan.step_time_s > 0


def test_expert_parallel_plans_add_the_balanced_token_all_to_alls():
    """A run's token all-to-alls depend on its routing; a plan prices them as balanced and
    dropless, which is what `cost.all_to_all_bytes` gives a run whose every rank sends and
    receives top_k rows per token (expert-choice routing at capacity factor 1 does)."""
    cfg = tiny_config("model.preset='tiny-moe'", "parallel.ep=2", "parallel.microbatches=2")
    dims = validate(cfg, 4)
    plan = estimate(cfg, dims, Cluster(4, 8, TOY))
    rank0 = describe_rank(cfg, dims, 0)
    args = cfg.model.args()
    tokens = cfg.train.global_batch // dims.rows // 2 * cfg.data.seq_len
    rows = [(tokens * args.moe_top_k, tokens * args.moe_top_k, True)] * (2 * args.n_layers)
    routed = all_to_all_bytes(rows, args.dim, 4, dims.ep)
    assert routed > 0 and plan.comm_bytes == float(rank0["traffic"].total + routed)


def test_pinning_every_degree_prices_that_plan_alone():
    cfg = tiny_config("model.n_layers=4")
    fixed = {"tp": 2, "pp": 2, "zero": 1, "dp_shard": 0, "microbatches": 4,
             "pp_schedule": "1f1b", "sequence_parallel": True, "activation_checkpointing": "none",
             "offload": "none"}
    plans = rank_plans(cfg, Cluster(8, 8, TOY), fixed)
    expected = {**fixed, "dp": 2, "cp": 1, "ep": 1, "cp_method": "ring", "pp_virtual": 1}
    assert len(plans) == 1 and plans[0].degrees == expected


def test_a_pinned_dp_is_kept_and_an_invalid_pin_says_why():
    """parallel.dp was not a pin: `plait plan parallel.dp=2` on 8 GPUs offered dp 4 without a
    word. A pin no layout satisfies is refused with validate's own reason (it said only "no
    layout is valid")."""
    from plait.planner.pins import pinned
    from plait.planner.policy import choose

    cfg = tiny_config("model.n_layers=4", "parallel.dp=2")
    fixed = pinned(cfg, ["parallel.dp=2"])
    assert fixed == {"dp": 2}
    plans = rank_plans(cfg, Cluster(8, 8, TOY), fixed)
    assert plans and {p.degrees["dp"] for p in plans} == {2}
    assert pinned(tiny_config("parallel.dp=0"), ["parallel.dp=0"]) == {}  # the rest: unpinned
    bad = tiny_config("model.n_layers=4", "parallel.dp=3")
    with pytest.raises(ConfigError, match=r"\(dp=3\) \(parallel: pp=1 \* dp=3 .* must equal the "
                       r"world size 8"):
        choose(bad, Cluster(8, 8, TOY), pinned(bad, ["parallel.dp=3"]))
    deep = tiny_config("model.n_layers=4", "parallel.pp=2", "parallel.pp_schedule='interleaved'",
                       "parallel.pp_virtual=8")
    with pytest.raises(ConfigError, match=r"parallel.pp: 16 pipeline chunks need >= 16 layers"):
        choose(deep, Cluster(8, 8, TOY), pinned(deep, ["parallel.pp=2", "parallel.pp_virtual=8",
                                                      "parallel.pp_schedule=interleaved"]))
    # Virtual stages pinned without a schedule are the interleaved schedule's: the search used to
    # offer 1F1B and ZB1 plans, which ignore them, and dropped the pin without a word. The
    # reason named is the pin's, not a searched value's (4 micro-batches of 2 sequences).
    deeper = tiny_config("model.n_layers=4", "parallel.pp=2", "parallel.pp_virtual=8")
    with pytest.raises(ConfigError, match=r"of the \d+ layouts tried: parallel.pp: 16 pipeline "
                       r"chunks need >= 16 layers"):
        choose(deeper, Cluster(8, 8, TOY), pinned(deeper, ["parallel.pp=2",
                                                          "parallel.pp_virtual=8"]))
    two = tiny_config("model.n_layers=4", "parallel.pp=2", "parallel.pp_virtual=2")
    plans = rank_plans(two, Cluster(8, 8, TOY), pinned(two, ["parallel.pp=2",
                                                             "parallel.pp_virtual=2"]))
    assert plans and {p.degrees["pp_schedule"] for p in plans} == {"interleaved"}


def test_virtual_stages_are_searched():
    """The interleaved schedule is tried with 2 virtual stages and each count up to 8 that cuts
    the layers into equal chunks (2 alone before: a published 405B layout pinned at 7 ran at 41%
    MFU where the planner offered 2 at 32.7%); the table and the JSON say which, and more chunks
    divide the bubble by more."""
    from plait.planner.search import virtual_stages
    from plait.planner.show import schedule

    assert virtual_stages(16, 2) == [2, 4, 8] and virtual_stages(126, 9) == [2, 7]
    cfg = tiny_config("model.n_layers=16")
    fixed = {"pp": 2, "pp_schedule": "interleaved", "microbatches": 2, "zero": 0,
             "activation_checkpointing": "none", "offload": "none"}
    plans = {p.degrees["pp_virtual"]: p for p in rank_plans(cfg, Cluster(2, 2, TOY), fixed)}
    assert sorted(plans) == [2, 4, 8]
    assert plans[8].bubble < plans[4].bubble < plans[2].bubble
    assert schedule(plans[4].degrees) == "interleaved x4"


def _warned(cfg, gpus, per_node, fixed, text):
    plans = rank_plans(cfg, Cluster(gpus, per_node, TOY), fixed)
    assert plans, fixed
    return any(text in w for w in plans[0].warnings)


def test_each_anti_pattern_is_flagged():
    cfg = tiny_config("model.n_layers=4")
    base = {"zero": 0, "activation_checkpointing": "none", "dp_shard": 0}
    assert _warned(cfg, 2, 1, {**base, "tp": 2, "pp": 1, "microbatches": 1},
                   "tensor parallelism across nodes")
    assert not _warned(cfg, 2, 2, {**base, "tp": 2, "pp": 1, "microbatches": 1},
                       "tensor parallelism across nodes")
    slow = Cluster(2, 2, dataclasses.replace(TOY, intra_gbps=10))
    assert any("slow links" in w for w in rank_plans(cfg, slow, {**base, "tp": 2})[0].warnings)
    assert _warned(cfg, 4, 8, {**base, "tp": 1, "pp": 4, "microbatches": 4,
                               "pp_schedule": "1f1b"}, "pipeline bubble")
    assert not _warned(cfg, 4, 8, {**base, "tp": 1, "pp": 4, "microbatches": 8,
                                   "pp_schedule": "1f1b"}, "pipeline bubble")
    # Interleaving 2 chunks a stage halves 1F1B's (p-1)/m = 75%: no warning (it used (p-1)/m).
    eight = tiny_config("model.n_layers=8", "parallel.pp_virtual=2")
    assert _warned(eight, 4, 8, {**base, "tp": 1, "pp": 4, "microbatches": 4,
                                 "pp_schedule": "1f1b"}, "pipeline bubble")
    assert not _warned(eight, 4, 8, {**base, "tp": 1, "pp": 4, "microbatches": 4,
                                     "pp_schedule": "interleaved"}, "pipeline bubble")
    assert _warned(cfg, 2, 8, {**base, "tp": 1, "pp": 1, "microbatches": 2},
                   "gradient accumulation")
    # ... only where one micro-batch is not slower: a plan whose accumulation is faster (the
    # search's own choice) does not carry the warning against itself.
    accumulating = with_degrees(cfg, microbatches=2, zero=0, activation_checkpointing="none",
                                dp_shard=0)
    dims = validate(accumulating, 2)
    plan = estimate(accumulating, dims, Cluster(2, 8, TOY))
    one = estimate(with_degrees(accumulating, microbatches=1), dims, Cluster(2, 8, TOY))
    for step_s, said in [(one.step_time_s, True), (0.9 * one.step_time_s, False)]:
        said_now = any("gradient accumulation" in w for w in warnings(
            dataclasses.replace(plan, step_time_s=step_s), accumulating, dims, Cluster(2, 8, TOY)))
        assert said_now == said, step_s
    # Samples are counted per data-parallel rank: 8 sequences on 16 GPUs (tp2 x pp2 x dp4) give
    # each replica's 2 stages 2 micro-batches; 4 on 8 GPUs (pp4 x dp2) leave 4 stages 2.
    ok = tiny_config("model.n_layers=4", "train.global_batch=8")
    assert not _warned(ok, 16, 8, {**base, "tp": 2, "pp": 2, "microbatches": 2,
                                   "pp_schedule": "1f1b"}, "samples")
    few = tiny_config("model.n_layers=4", "train.global_batch=4")
    assert _warned(few, 8, 8, {**base, "tp": 1, "pp": 4, "microbatches": 2,
                               "pp_schedule": "1f1b"}, "2 samples per data-parallel rank for 4")


def test_a_model_that_fits_nowhere_names_the_smallest_change():
    cfg = load_config(None, ["model.preset='7b'", "train.global_batch=8", "data.seq_len=1024"])
    with pytest.raises(ConfigError) as refused:
        choose(cfg, Cluster(1, 8, DEVICES["h100"]), {"pp": 1, "tp": 1, "offload": "none"})
    assert "does not fit" in str(refused.value) and "use 2 GPUs" in str(refused.value)


def test_the_zero_paper_model_state_table():
    """ZeRO (Rajbhandari et al. 2020), figure 1: a 7.5B-parameter model on 64 GPUs holds 120,
    31.4, 16.6 and 1.9 GB of model state per device at stages 0, 1, 2, 3 (mixed precision,
    Adam: 2 + 2 + 12 bytes per parameter, K = 12). plait's DDP is fp32 (4 + 4 + 8: the same
    16 bytes); stages 1-3 in bf16 with bf16 gradient reduction. The 7B preset with 36 layers and
    a 26,147-token vocabulary has 7,500,001,280 parameters."""
    cfg = load_config(None, ["model.preset='7b'", "model.n_layers=36", "model.vocab_size=26147",
                             "train.global_batch=64", "data.seq_len=1024"])
    paper = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in paper.items():
        c = cfg if stage == 0 else with_degrees(
            dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="bf16")),
            zero=stage, reduce_dtype="bf16")
        dims = validate(c, 64)
        plan = estimate(c, dims, Cluster(64, 8, DEVICES["h100"]))
        assert abs(plan.params / 7.5e9 - 1) < 1e-4
        state = sum(plan.memory_bytes[k] for k in ("params", "grads", "optimizer"))
        assert state / 1e9 == pytest.approx(gb, abs=0.1), stage


BF16 = ["train.precision='bf16'"]
FAST = {"pp_schedule": "1f1b", "activation_checkpointing": "none"}


@pytest.mark.parametrize("overrides,gpus,gpu,pins,chosen", [
    # 1-10B on 8 GPUs: data parallelism alone (1B: 16 GB of state; the ZeRO stage by time:
    # plait's ZeRO holds bf16 weights, which spares autocast's casts of fp32 ones, and shards
    # the optimizer's step), ZeRO when plain DP does not fit (7B: 108 GB of state).
    (["model.preset='1b'", "train.global_batch=256", "data.seq_len=4096"], 8, "h100", FAST,
     lambda d: d["tp"] == d["pp"] == 1),
    (["model.preset='7b'", "train.global_batch=256", "data.seq_len=4096"], 8, "h100", FAST,
     lambda d: d["tp"] == d["pp"] == 1 and d["zero"] >= 1),
    # 70B on 64: tensor parallelism within a node, pipeline stages across nodes.
    (["model.preset='70b'", "train.global_batch=512", "data.seq_len=4096"], 64, "h100",
     {**FAST, "zero": 1}, lambda d: 1 < d["tp"] <= 8 and d["pp"] > 1),
    # GPT-3 175B on 1024 A100s, tp 8 within each node: pipeline stages between nodes.
    (["model.preset='175b'", "train.global_batch=1536", "data.seq_len=2048"], 1024, "a100",
     {**FAST, "tp": 8, "zero": 1, "activation_checkpointing": "full"}, lambda d: d["pp"] > 1),
    # A mixture of experts: experts spread over the GPUs (ZeRO-1 keeps every parameter whole:
    # 8x7B's 47B would not fit otherwise).
    (["model.preset='8x7b'", "train.global_batch=512", "data.seq_len=4096"], 64, "h100",
     {"pp_schedule": "1f1b", "tp": 1, "pp": 1, "zero": 1}, lambda d: d["ep"] > 1),
    # 128K-token sequences: context parallelism.
    (["model.preset='7b'", "model.max_seq_len=131072", "train.global_batch=64",
      "data.seq_len=131072"], 64, "h100", {**FAST, "pp": 1, "zero": 1},
     lambda d: d["cp"] > 1),
], ids=["1b-8-ddp", "7b-8-zero", "70b-64-tp-pp", "175b-1024-pp", "8x7b-64-ep", "7b-128k-cp"])
def test_the_planner_follows_the_fields_decision_framework(overrides, gpus, gpu, pins, chosen):
    cfg = load_config(None, [*overrides, *BF16])
    best = rank_plans(cfg, Cluster(gpus, 8, DEVICES[gpu]), pins)[0]
    assert best.fits and chosen(best.degrees), best.degrees


def test_calibration_fits_alpha_beta_and_prices_this_machine(tmp_path, monkeypatch):
    """`plait plan --calibrate`'s fit recovers the latency and bandwidth that made the timings,
    and the stored result is the `cpu` device: links at the nearest measured world size,
    compute and overheads shared by ranks beyond the cores, no overlap then."""
    from plait.comm.collectives import Op, bus_bytes
    from plait.planner import calibrate
    from plait.planner.hardware import device

    alpha, beta, n = 300e-6, 1.5e9, 4
    samples = [(s, 2 * (n - 1) * alpha + float(bus_bytes(Op.ALL_REDUCE, n, s)) / beta)
               for s in calibrate.LINK_SIZES]
    fitted = calibrate.fit_alpha_beta(n, samples)
    assert fitted == pytest.approx((alpha, beta), rel=1e-6)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert calibrate.load() is None
    stored = {"matmul_flops": 1e11, "efficiency": 0.5, "step_overhead_s": 0.01,
              "microbatch_overhead_s": 0.002, "cores": 2, "measured_at": "now",
              "links": {"2": {"alpha_s": 1e-4, "beta_Bps": 1e9},
                        "4": {"alpha_s": 3e-4, "beta_Bps": 1.5e9}}}
    calibrate.path().parent.mkdir(parents=True)
    calibrate.path().write_text(__import__("json").dumps(stored))
    two, eight = device("cpu", ranks=2), device("cpu", ranks=8)
    assert (two.intra_alpha_s, two.intra_gbps, two.efficiency, two.overlap) == (1e-4, 1, 0.5,
                                                                                 False)
    assert (eight.intra_alpha_s, eight.intra_gbps, eight.efficiency) == (3e-4, 1.5, 0.125)
    assert eight.step_overhead_s == pytest.approx(0.04)
    cfg = tiny_config("model.n_layers=4")
    slow = estimate(cfg, validate(cfg, 8), Cluster(8, 8, eight)).step_time_s
    assert slow > estimate(cfg, validate(cfg, 2), Cluster(2, 2, two)).step_time_s


@pytest.mark.parametrize("zero", [2, 3])
def test_sharded_gradients_stay_sharded_during_backward(zero):
    """The peak of a step under ZeRO-2/3 holds the gradient slices plus the full-size staging of
    at most two buckets or units (the one reducing and the one filling) and one parameter's own
    gradient, not the whole model's gradient (which every rank staged until the end of backward
    before: 4 bytes per parameter whatever the number of ranks). 16 blocks, 1 MiB buckets."""
    cfg = tiny_config("model.n_layers=16", "model.dim=128", f"parallel.zero={zero}",
                      "parallel.bucket_mb=1")
    state = describe_rank(cfg, validate(cfg, 4), 0)["state"]
    n = sum(p.numel() for p in build_model(cfg.model.args(), 0, "meta").parameters())
    end = state["params"] + state["grads"] + state["optimizer"]
    assert state["peak"] - end < 4 * n / 4  # under a quarter of the whole fp32 gradient
    one = tiny_config("model.n_layers=16", "model.dim=128", f"parallel.zero={zero}",
                      "parallel.bucket_mb=1", "parallel.microbatches=2")
    accumulating = describe_rank(one, validate(one, 4), 0)["state"]
    # Micro-batches before the last accumulate whole gradients in the parameters (4n bytes).
    assert accumulating["peak"] - state["params"] - state["optimizer"] >= 4 * n


def test_a_pinned_plan_that_does_not_fit_is_still_priced():
    """The ZeRO paper's stage-0 row: 7.5B parameters of plain data parallelism on 64 GPUs hold
    120 GB each; with every degree pinned the plan is returned (and shown, status 1) with its
    warning, not refused; with a choice left the refusal names the model state as the cause."""
    cfg = load_config(None, ["model.preset='7b'", "model.n_layers=36", "model.vocab_size=26147",
                             "train.global_batch=64", "data.seq_len=1024"])
    pins = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 0, "dp_shard": 0, "microbatches": 1,
            "activation_checkpointing": "full", "offload": "none"}
    plans = choose(cfg, Cluster(64, 8, DEVICES["h100"]), pins)
    assert len(plans) == 1 and not plans[0].fits
    assert any(w.startswith("does not fit: 12") for w in plans[0].warnings)
    # The degrees alone pinned (recomputation, micro-batches, offload left to search): the
    # leanest variant, priced, not the refusal.
    degrees = {k: pins[k] for k in ("tp", "pp", "cp", "ep", "zero")}
    plans = choose(cfg, Cluster(64, 8, DEVICES["h100"]), degrees)
    assert len(plans) == 1 and not plans[0].fits and plans[0].degrees["zero"] == 0
    assert any(w.startswith("does not fit") for w in plans[0].warnings)
    big = load_config(None, ["model.preset='70b'", "train.global_batch=8", "data.seq_len=512",
                             "train.precision=bf16"])
    with pytest.raises(ConfigError) as refused:
        choose(big, Cluster(8, 8, DEVICES["h100"]), {"zero": 2, "tp": 1, "offload": "none"})
    assert "its model state alone needs" in str(refused.value), refused.value


def test_the_issues_pinned_command_is_shown_with_status_1(capsys):
    """`plait plan` with the ZeRO paper's stage-0 degrees pinned on the command line: the plan is
    printed with "does not fit", status 1 (it was refused with status 2). The fp32 softmax of
    1,024 x 26,147 logits (0.1 GB) is kept: on a GPU they are one run of the loss fused with the
    head (`vocab_parallel.logit_block`), so the unfused loss runs."""
    from plait import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", "--gpus", "64", "model.preset=7b", "model.n_layers=36",
                  "model.vocab_size=26147", "train.global_batch=64", "data.seq_len=1024",
                  "parallel.tp=1", "parallel.pp=1", "parallel.zero=0", "parallel.cp=1",
                  "parallel.ep=1"])
    out = capsys.readouterr().out
    assert exit_.value.code == 1 and "does not fit: 120.7 GB per GPU of 80 GB" in out


def test_four_24gb_gpus_train_7b_only_with_offload():
    """The seeds' exercise: a 7B model on 4 x 24 GB (RTX 4090) in bf16 fits only with its
    optimizer state in host memory (ZeRO-Offload): 16 bytes per parameter over 4 ranks is 27 GB
    each before any activation."""
    cfg = load_config(None, ["model.preset='7b'", "train.global_batch=16", "data.seq_len=1024",
                             "train.precision=bf16"])
    plans = rank_plans(cfg, Cluster(4, 8, DEVICES["rtx4090"]), {"tp": 1, "pp": 1})
    assert plans[0].fits and plans[0].degrees["offload"] != "none"
    assert not any(p.fits for p in plans if p.degrees["offload"] == "none")
    assert any(p.fits for p in plans if p.degrees["offload"] == "optimizer")
    assert plans[0].host_memory_bytes > 0
    # The CPU update at the rank's threads (one thread of plait's AdamW: 3.4 GB/s, measured),
    # said in a warning; with its share of the host's cores the same plan is faster.
    assert any("train.threads=1 thread(s)" in w for w in plans[0].warnings)
    threaded = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads=16))
    faster = rank_plans(threaded, Cluster(4, 8, DEVICES["rtx4090"]), {"tp": 1, "pp": 1})[0]
    assert faster.degrees == plans[0].degrees and faster.step_time_s < plans[0].step_time_s / 2
    assert not any("thread" in w for w in faster.warnings)


def test_a_70b_model_starts_on_80gb_devices():
    """Built on `meta`, a rank of 70B at tp2 x pp8 x dp4 holds its stage's slice in fp32 while
    it starts (26 GB), not the whole model (280 GB in fp32 on every rank, as before #30)."""
    cfg = load_config(None, ["model.preset='70b'", "train.global_batch=64", "data.seq_len=4096",
                             "train.precision=bf16", "parallel.tp=2", "parallel.pp=8",
                             "parallel.zero=1", "parallel.sequence_parallel=true"])
    plan = estimate(cfg, validate(cfg, 64), Cluster(64, 8, DEVICES["h100"]))
    assert 0 < plan.startup_bytes < 80e9 < 4 * plan.params
    assert plan.peak_memory_bytes >= plan.startup_bytes


def test_fp16_is_priced_as_bf16_and_bf16_on_a_v100_is_flagged():
    """fp16 keeps the sizes of bf16 (2-byte parameters and activations under autocast and ZeRO):
    every plan of 1B on 8 V100s prices both alike, byte for byte; bf16 there gets a warning (no bf16
    tensor cores), fp16 none."""
    base = ["model.preset='1b'", "train.global_batch=32", "data.seq_len=1024", "parallel.zero=1"]
    cluster = Cluster(8, 8, DEVICES["v100"])
    bf16, fp16 = (rank_plans(load_config(None, [*base, f"train.precision={p}"]), cluster,
                             {"tp": 1, "pp": 1}) for p in ("bf16", "fp16"))
    assert [(p.degrees, p.memory_bytes, p.step_time_s) for p in bf16] == \
        [(p.degrees, p.memory_bytes, p.step_time_s) for p in fp16]
    assert any("no bf16 tensor cores" in w for w in bf16[0].warnings)
    assert not any("bf16" in w for w in fp16[0].warnings)


def test_one_link_per_node_is_shared_by_the_groups_crossing_it():
    """On nodes of 4 with one inter-node link each (`node_link`, emulated nodes), the groups of an
    axis crossing a node at once share it: stride 1 (tp8: one ring, entering and leaving each node
    once), stride 2 (2 rings), stride 4 and 8 (each of the node's 4 ranks in its own group); a
    GPU cluster's NIC per GPU is never shared; inside a node nothing changes."""
    shared = Cluster(16, 4, dataclasses.replace(TOY, node_link=True))
    per_gpu = Cluster(16, 4, TOY)
    GB = 1e9
    assert [shared.link(s, n)[0] for s, n in ((1, 8), (2, 4), (4, 2), (8, 2))] == \
        [1 * GB, GB / 2, GB / 4, GB / 4]
    assert {per_gpu.link(s, n)[0] for s, n in ((1, 8), (2, 4), (4, 2), (8, 2))} == {GB}
    assert shared.link(1, 4) == per_gpu.link(1, 4) == (10 * GB, TOY.intra_alpha_s)


def test_the_hierarchical_all_reduce_is_priced_per_link():
    """dp8 on 2 nodes of 4, DDP's all-reduce hierarchical: its groups are priced on their own
    links, the node's 4 dp ranks (stride 1) on the intra-node one, the 2 nodes' (stride 4) on the
    inter-node one, each call by the alpha-beta model; over the slow link it moves 1/7 of the flat
    ring's bus bytes (2 (n-1)/n of D/4 at n = 2, against of D at n = 8)."""
    from plait.planner.price import _comm_seconds, _group_shape

    cluster, priced = Cluster(8, 4, TOY), {}
    for allreduce in ("ring", "hierarchical"):
        cfg = tiny_config(f"parallel.allreduce='{allreduce}'", "parallel.ranks_per_node=4")
        dims = validate(cfg, 8)
        traffic = describe_rank(cfg, dims, 0)["traffic"]
        priced[allreduce] = traffic.groups, _comm_seconds(traffic, dims, cluster, node=4)
    assert _group_shape(dims, "dp_node", 4) == (1, 4) and cluster.within_node(1, 4)
    assert _group_shape(dims, "dp_nodes", 4) == (4, 2) and not cluster.within_node(4, 2)
    (flat, _), (groups, seconds) = priced["ring"], priced["hierarchical"]
    assert set(seconds) == {"dp_node", "dp_nodes"}
    (calls, across), = groups["dp_nodes"].values()  # one all-reduce per bucket
    assert seconds["dp_nodes"] == pytest.approx(calls * 2 * TOY.inter_alpha_s + across / 1e9)
    inside = sum(calls * 3 * TOY.intra_alpha_s + moved / 10e9  # n - 1 steps each half
                 for calls, moved in groups["dp_node"].values())
    assert seconds["dp_node"] == pytest.approx(inside)
    (_, ring), = flat["dp"].values()
    assert across * 7 == pytest.approx(ring, rel=0.01)  # buckets padded to a multiple of 4


@pytest.mark.parametrize("preset,gpus", [
    ("small", 8), ("small-moe", 8), ("125m", 8), ("1b", 16), ("7b", 8),
    ("8x7b", 8), ("70b", 64), ("405b", 128)])
def test_a_pipeline_saves_at_most_half_the_model_state_of_its_mesh(preset, gpus):
    """The bound `choose` refuses by before its search: the leanest layout without a pipeline
    holds less than PIPELINE_SAVES times the model state of the leanest of every layout."""
    cfg = load_config(None, [f"model.preset='{preset}'", "train.global_batch=16",
                             "data.seq_len=256"])
    cluster = Cluster(gpus, 8, DEVICES["h100"])
    flat, every = leanest(cfg, cluster, {}, pipelines=False), leanest(cfg, cluster, {})
    assert every.peak_memory_bytes - every.memory_bytes["activations"] <= \
        flat.peak_memory_bytes - flat.memory_bytes["activations"]
    assert (flat.peak_memory_bytes - flat.memory_bytes["activations"]) / PIPELINE_SAVES < \
        every.peak_memory_bytes - every.memory_bytes["activations"]


def test_a_model_far_beyond_its_gpus_is_refused_by_the_bound_before_the_search(monkeypatch):
    def searched(*a, **k):
        raise AssertionError("searched")

    monkeypatch.setattr("plait.planner.policy.rank_plans", searched)
    cfg = load_config(None, ["model.preset='405b'", "train.global_batch=16"])
    with pytest.raises(ConfigError, match="its model state alone needs over 835.0 GB per GPU"):
        choose(cfg, Cluster(1, 8, DEVICES["h100"]), {})


def test_a_device_variant_of_another_peak_is_priced_at_it():
    """`--gpu-tflops`: the dense bf16 peak a published run's devices had, not the datasheet's."""
    from plait.planner.hardware import device

    slow = device("h100", tflops=494.5)
    assert slow.peak_flops == 494.5e12 and "494.5 TFLOP/s" in slow.name
    cfg = load_config(None, ["model.preset='7b'", "train.global_batch=16", "data.seq_len=1024",
                             "parallel.zero=3"])
    dims = validate(cfg, 8)
    fast = estimate(cfg, dims, Cluster(8, 8, DEVICES["h100"]))
    priced = estimate(cfg, dims, Cluster(8, 8, slow))
    assert priced.step_time_s > fast.step_time_s
    assert priced.memory_bytes == fast.memory_bytes  # a rate, not a size


def test_the_h100_card_forms_are_priced_as_their_datasheets_say():
    """The same tp2 layout of the 1B preset on 8 H100s: the PCIe card (756 TFLOP/s, its cards
    joined by PCIe 5.0) takes longer than the SXM module (989, NVLink 4), the NVL card (835,
    94 GB) between them and with more memory."""
    cfg = load_config(None, ["model.preset='1b'", "train.global_batch=16", "data.seq_len=1024",
                             "parallel.tp=2", "parallel.zero=1"])
    dims = validate(cfg, 8)
    step = {gpu: estimate(cfg, dims, Cluster(8, 8, DEVICES[gpu])).step_time_s
            for gpu in ("h100", "h100-nvl", "h100-pcie")}
    assert step["h100"] < step["h100-nvl"] < step["h100-pcie"]
    assert DEVICES["h100-nvl"].memory_bytes == 94e9 > DEVICES["h100-pcie"].memory_bytes


def test_a_cpu_device_is_priced_by_its_calibrated_rate_not_the_gpu_shape_model():
    """`plait plan --calibrate` divides a step's FLOPs by an ideal CPU device's time: that device
    (gloo) must be priced as FLOPs over its rate, so one rank without recomputation runs at 100%
    of it (priced by the GPU's shape model, the calibration read 22,835%)."""
    from plait.planner.hardware import Device

    ideal = Device("ideal", 1e11, 1e12, 1.0, 1.0, efficiency=1.0, gloo=True)
    cfg = load_config(None, ["model.preset='small'", "train.global_batch=1", "data.seq_len=128"])
    plan = estimate(cfg, validate(cfg, 1), Cluster(1, 1, ideal))
    assert plan.mfu == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("cuda_name,key", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"), ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A10G", "a10"),
    ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"), ("Tesla V100-SXM2-32GB", "v100"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"), ("NVIDIA RTX A6000", "a6000"), ("Some GPU", None)])
def test_a_cuda_device_name_finds_its_datasheet(cuda_name, key):
    """What MFU divides by on a GPU (`metrics.peak_flops`) and what `plait bench gemm` models:
    the planner's table, by the names CUDA reports (an H100 PCIe is not the SXM's 989 TFLOP/s;
    an A10G is an A10; an A100 is not an A10)."""
    from plait.planner.hardware import known_device

    assert known_device(cuda_name) is (DEVICES[key] if key else None)


def test_the_plan_says_tensor_parallelism_is_not_overlapped():
    """plait's tp collectives sit on the critical path (no async TP): the plan's reasons say so,
    with the communication left exposed, which a tp layout has and a data-parallel one hides."""
    from plait.planner.search import reasons

    cfg = load_config(None, ["model.preset='1b'", "train.global_batch=64", "data.seq_len=4096",
                             *BF16])
    cluster = Cluster(8, 8, DEVICES["h100"])
    tp = rank_plans(cfg, cluster, {**FAST, "tp": 8, "pp": 1, "cp": 1})[0]
    said = "; ".join(reasons(tp, cluster))
    assert tp.comm_s > 0 and "does not overlap them" in said
    assert f"communication not hidden: {tp.comm_s:.3g} s" in said
    dp = rank_plans(cfg, cluster, {**FAST, "tp": 1, "pp": 1, "cp": 1, "zero": 0})[0]
    assert "does not overlap" not in "; ".join(reasons(dp, cluster))


def test_plans_rank_fits_then_speed_with_the_simplest_near_the_fastest_first():
    """`search.ranked`, `plait plan`'s order and `plait.plan`'s: what fits, fastest first; but a
    lower ZeRO stage within 2% of the fastest's throughput leads (more collectives cost what the
    time model does not price); nothing fits: the order alone."""
    rows = {"zero3": (True, 1.00, 3, 10), "ddp": (True, 1.01, 0, 50),
            "slow": (True, 1.05, 0, 5), "big": (False, 0.5, 0, 1)}
    assert ranked(list(rows), rows.get) == ["ddp", "zero3", "slow", "big"]
    rows["ddp"] = (True, 1.03, 0, 50)  # 3% slower: speed wins
    assert ranked(list(rows), rows.get) == ["zero3", "ddp", "slow", "big"]
    none = {k: (False, *v[1:]) for k, v in rows.items()}
    assert ranked(list(none), none.get) == ["big", "zero3", "ddp", "slow"]


def test_zero3_gathers_no_prefetch_starts_are_priced_exposed():
    """`cost.unprefetched_share`: of a ZeRO-3 step's gathered elements, those no prefetch starts
    ahead, which the planner prices exposed (`price.stage_seconds`). The tiny Llama of 4 blocks
    (embedding 16,384, block 46,208, norm + head 16,448 elements): per unit a block, the
    forward's first (the embedding) and the backward's first (the head). Cut below the blocks
    (norms left over, 576, spanning; attention 12,288, feed-forward 33,792) with prefetching
    bounded at 48,000: the norms in both passes, the head in both (feed-forward + head would
    pass the bound in the forward; in the backward it runs first), and in the backward the last
    feed-forward, which the head's 16,384 beside it holds back. ZeRO-1: nothing gathered."""
    from training import tiny_config

    from plait.planner.price import _placed
    from plait.predict import cost
    from plait.train.checks import validate

    def share(*overrides):
        cfg = tiny_config("model.n_layers=4", *overrides)
        record = _placed(cfg.model, 1, 1, 1, (4,), 0, False, cfg.parallel.wrap)
        return cost.unprefetched_share(cfg, validate(cfg, 2), record)

    blocks = 16384 + 4 * 46208 + 16448
    assert share("parallel.zero=3") == (16384 + 16448) / (2 * blocks)
    below = 576 + 16384 + 4 * (12288 + 33792) + 16384
    assert share("parallel.zero=3", "parallel.wrap='Attention,FeedForward,Embedding,Linear'",
                 "parallel.max_live_params=48000") == \
        (576 + 16384 + 576 + 16384 + 33792) / (2 * below)
    assert share("parallel.zero=1") == 0.0
    # Priced exposed: a 70B at ZeRO-3 whose compute hides all its gathers when prefetched
    # waits for them all when none is (a bound of one element).
    base = ["model.preset='70b'", "data.seq_len=4096", "train.global_batch=1024",
            "train.precision='bf16'", "parallel.zero=3", "parallel.microbatches=16"]
    cluster = Cluster(64, 8, DEVICES["a100"])
    free, bound = (estimate(c, validate(c, 64), cluster) for c in (
        load_config(None, base), load_config(None, [*base, "parallel.max_live_params=1"])))
    assert bound.comm_s > free.comm_s and bound.step_time_s > free.step_time_s
