"""Configuration loading, and bad input: status 2 and one line naming the field, before any worker
starts."""

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

from plait import cli
from plait.config.checks_train import compile_backends
from plait.config.schema import ConfigError, load_config
from plait.train.checks import validate


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


MANIFESTS = {
    "vocab_text": lambda m: {**m, "vocab_size": "256"},
    "vocab_float": lambda m: {**m, "vocab_size": 256.5},
    "dtype_unknown": lambda m: {**m, "dtype": "int8"},
    "dtype_wrong": lambda m: {**m, "dtype": "uint32"},  # the shard's bytes are uint16's
    "dtype_narrow": lambda m: {**m, "vocab_size": 70000},
    "shard_outside": lambda m: {**m, "shards": [{**m["shards"][0], "file": "../prepared/x"}]},
    "no_tokens": lambda m: {**m, "shards": [{**m["shards"][0], "tokens": 0, "bytes": 0}]},
    "not_object": lambda m: [m],
    "documents_text": lambda m: {**m, "documents": "4"},
    "tokens_off": lambda m: {**m, "tokens": m["tokens"] + 1},
    "block_odd": lambda m: {**m, "block_bytes": 3},  # not whole uint16 ids
    "checksums_elsewhere": lambda m: {**m, "checksums": "../checksums.npy"},
}
# The documents' index (documents.npy) damaged: a launch read it in its workers (a pickle's
# traceback, or a wrong split and a misleading count of windows).
INDEXES = {
    "index_garbage": b"not an array",
    "index_short": np.array([0, 2800], dtype=np.int64),
    "index_unordered": np.array([0, 1400, 700, 2100, 2800], dtype=np.int64),
    "index_float": np.array([0, 700, 1400, 2100, 2800], dtype=np.float64),
}


BAD_INPUT = [
    # (arguments, the field the one-line message must name)
    (["model.nonsense=1"], "model.nonsense"),
    (["train.stepz=3"], "train.stepz"),
    (["optimizer.lr=1"], "optimizer.lr"),
    (["train.steps=many"], "train.steps"),
    (["train.steps"], "train.steps"),
    (["parallel.tp=2", "--nproc", "3"], "parallel"),
    (["--nnodes", "2:1", "--nproc", "1", "--rdzv-endpoint", "localhost:1"], "--nnodes"),
    (["--nnodes", "two", "--nproc", "1", "--rdzv-endpoint", "localhost:1"], "--nnodes"),
    (["--nnodes", "2", "--nproc", "1"], "--rdzv-endpoint"),
    (["--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", "h:99999"], "--rdzv-endpoint"),
    (["--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", "h"], "--rdzv-endpoint"),
    (["--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", "node7.invalid:29500"],
     "--rdzv-endpoint"),  # torchrun retried the name for minutes, then a traceback
    (["--metrics", "/sys/plait/m.jsonl"], "--metrics"),  # root passes os.access; /sys refuses
    (["--metrics", "/proc/m.jsonl"], "--metrics"),
    (["--nnodes", "2", "--rdzv-endpoint", "localhost:1"], "--nproc"),
    (["--local-addr", "10.0.0.2", "--nproc", "1"], "--nnodes"),
    (["--nnodes", "2", "--nproc", "2", "--rdzv-endpoint", "localhost:1", "parallel.tp=8"],
     "parallel"),
    (["parallel.dp=2", "--nproc", "4"], "parallel"),
    (["parallel.tp=3", "parallel.dp=1", "--nproc", "3"], "parallel.tp"),
    (["parallel.pp=4", "parallel.dp=1", "--nproc", "4", "model.n_layers=2"], "parallel.pp"),
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
    (["parallel.wrap='Block, 2x'"], "parallel.wrap"),  # neither class names nor a count
    (["parallel.wrap=TransformerBlock", "parallel.zero=3"], "parallel.wrap"),  # not Llama's
    (["parallel.max_live_params=-1", "parallel.zero=3"], "parallel.max_live_params"),
    (["parallel.max_live_params=1000"], "parallel.max_live_params"),  # not ZeRO-3
    (["parallel.max_live_params=1000", "parallel.zero=3",
      "parallel.reshard_after_forward=false"], "parallel.max_live_params"),
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
    # Numbers: finite and in range.
    (["train.lr=nan"], "train.lr"),
    (["train.lr=inf"], "train.lr"),
    (["train.lr=-1"], "train.lr"),
    (["train.lr=1e400"], "train.lr"),
    (["train.beta1=1.5"], "train.beta1"),
    (["train.beta2=-0.1"], "train.beta2"),
    (["train.lr_scaling=linear", "train.base_batch=0"], "train.base_batch"),
    (["train.lr_scaling=cubic"], "train.lr_scaling"),
    (["train.grad_clip=-1"], "train.grad_clip"),
    (["train.weight_decay=-0.1"], "train.weight_decay"),
    (["train.min_lr_ratio=-0.5"], "train.min_lr_ratio"),
    (["train.min_lr_ratio=2"], "train.min_lr_ratio"),
    (["train.eval_every=-1"], "train.eval_every"),
    (["train.eval_batches=0"], "train.eval_batches"),
    (["train.peak_tflops=-1"], "train.peak_tflops"),
    (["train.threads=0"], "train.threads"),
    (["train.compile=yes"], "train.compile"),
    (["train.compile=1"], "train.compile"),
    (["train.compile=true", "train.compile_backend=nonesuch"], "train.compile_backend"),
    (["train.steps=0"], "train.steps"),
    (["train.steps=3.5"], "train.steps"),
    (["train.global_batch=0"], "train.global_batch"),
    (["train.seed=1.5"], "train.seed"),
    (["train.nan_policy=ignore"], "train.nan_policy"),
    (["train.optimizer=lion"], "train.optimizer"),
    (["train.muon_momentum=1.0"], "train.muon_momentum"),
    (["train.sgd_momentum=-0.1"], "train.sgd_momentum"),
    (["train.muon_ns_steps=0"], "train.muon_ns_steps"),
    (["train.muon_adjust_lr=rms"], "train.muon_adjust_lr"),
    (["train.muon_lr_ratio=0"], "train.muon_lr_ratio"),
    (["train.muon_lr_ratio=1e300"], "train.muon_lr_ratio"),  # overflowed at step 1
    (["train.optimizer=muon", "parallel.zero=1", "parallel.offload=optimizer"],
     "train.optimizer"),
    (["train.stop_after=-1"], "train.stop_after"),
    (["train.steps=40", "train.stop_after=50"], "train.stop_after"),
    (["checkpoint.every=-2", "checkpoint.dir={files}/ck"], "checkpoint.every"),
    (["checkpoint.every=2"], "checkpoint.every"),  # no dir to save in
    (["checkpoint.keep=0"], "checkpoint.keep"),
    (["checkpoint.async=yes"], "checkpoint.async"),
    (["checkpoint.dir={files}/tiny.txt/ck"], "checkpoint.dir"),  # under a file
    (["checkpoint.resume={files}/empty_dir"], "checkpoint.resume"),  # holds no checkpoint
    (["checkpoint.resume={files}/ck_tiny", "model.dim=240"], "checkpoint.resume"),  # other model
    (["checkpoint.resumee=auto"], "checkpoint.resumee"),
    (["train.activation_checkpointing=true"], "train.activation_checkpointing"),
    (["model.multiple_of=0"], "model.multiple_of"),
    (["model.norm_eps=-1"], "model.norm_eps"),
    (["model.rope_theta=0"], "model.rope_theta"),
    (["model.ffn_multiplier=0"], "model.ffn_multiplier"),
    (["model.dim=0"], "model.dim"),
    (["model.n_layers=0"], "model.n_layers"),
    (["model.n_heads=5"], "model.dim"),  # 192 is not a multiple of 5
    (["model.dim=60", "model.n_heads=4"], "model.dim"),  # odd head dim: no rotary pairs
    (["model.n_kv_heads=0"], "model.n_kv_heads"),
    (["model.max_seq_len=0"], "model.max_seq_len"),
    (["model.vocab_size=100"], "model.vocab_size"),  # bytes need 256
    (["data.max_bytes=-1"], "data.max_bytes"),
    (["data.val_fraction=1.5"], "data.val_fraction"),
    (["data.val_fraction=0"], "data.val_fraction"),
    (["data.seq_len=0"], "data.seq_len"),
    # Parallel keys.
    (["parallel.zero=4"], "parallel.zero"),
    (["parallel.reduce_dtype=fp16"], "parallel.reduce_dtype"),  # a fp32 run
    (["parallel.reduce_dtype=bf16", "train.precision=fp16"], "parallel.reduce_dtype"),
    (["parallel.reduce_dtype=fp8"], "parallel.reduce_dtype"),
    (["train.param_dtype=fp8"], "train.param_dtype"),
    (["train.param_dtype=bf16"], "train.param_dtype"),  # a fp32 run
    (["train.precision=bf16", "train.param_dtype=bf16", "train.optimizer=muon"],
     "train.param_dtype"),  # flat masters under DDP; Muon wants whole matrices
    # fp16's loss scale.
    (["train.precision=fp16", "train.loss_scale=auto"], "train.loss_scale"),
    (["train.precision=fp16", "train.loss_scale=0"], "train.loss_scale"),
    (["train.precision=fp16", "train.loss_scale=true"], "train.loss_scale"),
    (["train.loss_scale=1024"], "train.loss_scale"),  # not fp16
    (["train.precision=fp16", "train.loss_scale_init=-1"], "train.loss_scale_init"),
    (["train.precision=fp16", "train.loss_scale_init=1e300"], "train.loss_scale_init"),
    (["train.precision=fp16", "train.loss_scale_growth_interval=0"],
     "train.loss_scale_growth_interval"),
    (["train.precision=fp16", "train.loss_scale_hysteresis=0"], "train.loss_scale_hysteresis"),
    (["train.precision=fp16", "train.loss_scale_min=1e9"], "train.loss_scale_min"),
    (["parallel.offload=disk"], "parallel.offload"),
    (["parallel.offload=optimizer"], "parallel.offload"),  # without ZeRO
    (["parallel.offload=params", "parallel.zero=1"], "parallel.offload"),
    (["parallel.bucket_mb=0"], "parallel.bucket_mb"),
    (["parallel.allreduce=tree"], "parallel.allreduce"),
    (["parallel.reshard_after_forward=maybe"], "parallel.reshard_after_forward"),
    (["parallel.tp=0"], "parallel.tp"),
    (["parallel.pp=0"], "parallel.pp"),
    (["parallel.dp_shard=-1"], "parallel.dp_shard"),
    (["parallel.microbatches=-1"], "parallel.microbatches"),
    # Context parallelism: the sequence must cut into 2C (ring) or C (Ulysses) equal pieces,
    # Ulysses must split the heads of each tp rank; the method must be known.
    (["parallel.cp=2", "--nproc", "2", "data.seq_len=30"], "data.seq_len"),
    (["parallel.cp=2", "--nproc", "2", "parallel.cp_method=ulysses", "data.seq_len=31"],
     "data.seq_len"),
    (["parallel.cp=4", "--nproc", "4", "parallel.cp_method=ulysses"], "parallel.cp"),  # 6 heads
    (["parallel.cp=2", "parallel.tp=2", "--nproc", "4", "parallel.cp_method=ulysses",
      "model.n_heads=2", "model.n_kv_heads=2", "model.dim=64"], "parallel.cp"),  # 1 head per tp
    (["parallel.cp_method=zigzag"], "parallel.cp_method"),
    (["parallel.cp=2", "--nproc", "2", "model.preset='tiny-moe'"], "parallel.cp"),
    (["parallel.cp=2", "parallel.tp=2", "--nproc", "4", "parallel.cp_method=ulysses",
      "parallel.sequence_parallel=true", "data.seq_len=34"], "parallel.sequence_parallel"),
    (["parallel.ep=2", "--nproc", "2"], "parallel.ep"),  # a dense model: nothing to split
    # Mixture of experts.
    (["model.preset='tiny-moe'", "parallel.ep=3", "--nproc", "3"], "parallel.ep"),  # 8 % 3
    (["model.preset='tiny-moe'", "parallel.ep=2", "--nproc", "3"], "parallel"),  # world 3
    (["model.preset='tiny-moe'", "model.moe_top_k=9"], "model.moe_top_k"),  # > 8 experts
    (["model.preset='tiny-moe'", "model.moe_top_k=0"], "model.moe_top_k"),
    (["model.preset='tiny-moe'", "model.moe_capacity_factor=-1.0"], "model.moe_capacity_factor"),
    (["model.preset='tiny-moe'", "model.moe_router='hash'"], "model.moe_router"),
    (["model.moe_experts=-2"], "model.moe_experts"),
    (["model.preset='tiny-moe'", "model.moe_every=0"], "model.moe_every"),
    (["model.preset='tiny-moe'", "model.moe_aux_loss_coef=-0.1"], "model.moe_aux_loss_coef"),
    (["model.preset='tiny-moe'", "parallel.ep=2", "--nproc", "2", "train.global_batch=3"],
     "train.global_batch"),
    (["parallel.pp=2", "--nproc", "2", "parallel.pp_schedule=interleaved",
      "parallel.pp_virtual=3"], "parallel.pp"),  # 6 chunks, 4 layers
    (["parallel.pp=2", "--nproc", "2", "parallel.pp_split=[4, 0]"], "parallel.pp_split"),
    (["--nproc", "0"], "--nproc"),
    # Gradient compression: unknown, out of range, or where a method cannot apply.
    (["parallel.compression=zip"], "parallel.compression"),
    (["parallel.compression=topk", "parallel.compression_ratio=0"], "parallel.compression_ratio"),
    (["parallel.compression=topk", "parallel.compression_ratio=1.5"],
     "parallel.compression_ratio"),
    (["parallel.compression=powersgd", "parallel.compression_rank=0"],
     "parallel.compression_rank"),
    (["parallel.compression_start=-1"], "parallel.compression_start"),
    (["parallel.compression=topk", "parallel.zero=3"], "parallel.compression"),
    (["parallel.compression=powersgd", "parallel.zero=3"], "parallel.compression"),
    (["parallel.compression=sign", "parallel.zero=3"], "parallel.compression"),
    (["parallel.compression=topk", "parallel.zero=1", "parallel.dp_shard=2", "--nproc", "4"],
     "parallel.compression"),  # hybrid sharding compresses elementwise only
    (["parallel.compression=int8", "parallel.allreduce=ring"], "parallel.compression"),
    (["parallel.compression=bf16", "parallel.zero=2", "train.precision=bf16",
      "parallel.reduce_dtype=bf16"], "parallel.compression"),
    (["parallel.compression=topk", "parallel.zero=2", "train.precision=fp16",
      "parallel.reduce_dtype=fp16"], "parallel.compression"),
    (["parallel.allreduce=hierarchical", "parallel.zero=1", "--nproc", "2"],
     "parallel.allreduce"),  # ZeRO's hierarchy is hybrid sharding
    (["parallel.ranks_per_node=3", "--nproc", "4"], "parallel.ranks_per_node"),
    (["parallel.ranks_per_node=-1"], "parallel.ranks_per_node"),
    (["parallel.allreduce=hierarchical", "parallel.tp=2", "parallel.ranks_per_node=1",
      "--nproc", "2"], "parallel.ranks_per_node"),  # a node must hold whole tp groups
    (["train=3"], "train=3"),  # not section.key=value
    (["model.preset=tiny", "data.seq_len=65"], "data.seq_len"),  # beyond max_seq_len 64
    # Files: the recipe, the data, the metrics path (created by the `files` fixture).
    (["--config", "{files}/latin1.toml"], "--config"),
    (["--config", "{files}/broken.toml"], "--config"),
    (["--config", "{files}/sections.toml"], "optimizer"),
    (["data.source={files}/empty.txt"], "data.source"),
    (["data.source={files}/tiny.txt"], "data.source"),
    (["data.source={files}/empty_dir"], "data.source"),
    (["data.source={files}/three.bin"], "data.source"),
    (["data.source={files}/odd.bin"], "data.source"),
    (["data.source={files}/ids.bin"], "model.vocab_size"),
    (["data.source={files}/ids.bin", "parallel.tp=2", "--nproc", "2"], "model.vocab_size"),
    # model.hf folders refused from their files alone, without torch (they took 4-9 s)
    (["model.hf={files}/hf_cut"], "model.hf"),  # a weights file cut short
    (["model.hf={files}/hf_garbled_config"], "model.hf"),
    (["model.hf={files}/hf_remote"], "model.hf"),  # auto_map: code of its own
    (["model.hf={files}/hf_missing_tensor", "parallel.tp=3", "parallel.dp=1", "--nproc", "3"],
     "parallel.tp"),  # 2 heads
    (["model.hf={files}/hf_unplanned", "parallel.tp=2", "parallel.dp=1", "--nproc", "2"],
     "parallel.tp"),  # BLOOM: no plan (read from config.json; took 12-14 s through transformers)
    (["data.document_mask=3"], "data.document_mask"),
    (["data.source={files}/ids.bin", "model.vocab_size=512", "data.document_mask=true"],
     "data.document_mask"),  # a .bin does not say where its documents begin
    # Prepared corpora (plait data prepare): too big a vocabulary, damaged shards, too few windows.
    (["data.source={files}/bpe"], "model.vocab_size"),  # 300 tokens, the model 256
    (["data.source={files}/no_shard"], "data.source"),
    (["data.source={files}/cut_shard"], "data.source"),
    (["data.source={files}/flipped"], "data.source"),  # in a sampled block: its crc32 differs
    # A mixture (data.sources): each entry, then each folder as data.source's, one tokenizer.
    (["data.sources=[1, 2]"], "data.sources"),
    (['data.sources=[{path="{files}/prepared", weight=0}]'], "data.sources[0].weight"),
    # 1e308 each: finite, but two of them summed to inf and every row came from one source
    (['data.sources=[{path="{files}/prepared", weight=1e308}]'], "data.sources[0].weight"),
    (['data.sources=[{path="{files}/prepared", weight=1, size=3}]'], "data.sources[0].size"),
    (['data.sources=[{path="{files}/prepared", weight=1, name="a b"}]'], "data.sources[0].name"),
    (['data.sources=[{path="{files}/prepared", weight=1}, {path="{files}/prepared", weight=2}]'],
     "data.sources[1].name"),  # two sources named "prepared"
    (["data.source={files}/prepared", 'data.sources=[{path="{files}/prepared", weight=1}]'],
     "data.sources"),
    (["data.max_bytes=1000", 'data.sources=[{path="{files}/prepared", weight=1}]'],
     "data.max_bytes"),
    (['data.sources=[{path="{files}/nothing", weight=1}]'], "data.sources[0].path"),
    (['data.sources=[{path="{files}/tiny.txt", weight=1}]'], "data.sources[0].path"),
    (['data.sources=[{path="{files}/flipped", weight=1}]'], "data.sources[0].path"),
    (['data.sources=[{path="{files}/prepared", weight=1}, {path="{files}/bpe", weight=1}]',
      "model.vocab_size=512"], "data.sources[1].path"),  # tokenized otherwise
    (["data.source={files}/checksums_short"], "data.source"),
    (["data.source={files}/checksums_garbage"], "data.source"),
    (["data.source={files}/prepared", "train.global_batch=128"], "data.source"),  # 43 windows
    (["data.source={files}/no_manifest_fields"], "data.source"),
    # Manifests that passed the check and crashed a worker: wrong types and values, a dtype
    # whose byte sizes do not match, a shard outside the folder, shards of no token.
    *[(["data.source={files}/manifest_" + name], "data.source") for name in MANIFESTS],
    *[(["data.source={files}/" + name], "data.source") for name in INDEXES],
    (["data.source={files}/index_missing"], "data.source"),  # checksums, so not an old corpus
    (["data.source={files}/index_folder"], "data.source"),
    (["--metrics", "{files}/tiny.txt/m.jsonl"], "--metrics"),  # the parent is a file
    (["--metrics", "{files}/empty_dir"], "--metrics"),  # a directory
    (["--tensorboard", "{files}/tiny.txt"], "--tensorboard"),  # a file
    (["--tensorboard", "{files}/tiny.txt/runs"], "--tensorboard"),  # under a file
    (["--trace", "{files}/tiny.txt"], "--trace"),  # a file
    (["--trace", "{files}/traces", "--trace-steps", "0"], "--trace-steps"),
]

# The other commands' own options, refused the same way before anything starts.
OTHER_BAD_INPUT = [
    (["bench", "comm", "--min-seconds", "-1"], "--min-seconds"),  # ran 45 s
    (["bench", "scaling", "--nproc", "2,1"], "--nproc"),  # not increasing
    (["bench", "scaling", "--nproc", "0,1"], "--nproc"),
    (["bench", "scaling", "--nproc", "two"], "--nproc"),
    (["bench", "scaling", "--steps", "0"], "--steps"),
    (["bench", "gemm", "--steps", "0"], "--steps"),
    (["bench", "scaling", "--png", "{files}/empty_dir"], "--png"),  # a directory
    (["bench", "pp", "--png", "/proc/plait-nope/pp.png"], "--png"),  # was a mkdir traceback
    (["bench", "compression", "--png", "/proc/plait-nope/c.png"], "--png"),
    (["bench", "scaling", "parallel.tp=3"], "parallel"),  # tp 3 at world size 1
    (["bench", "cp", "--cp", "1"], "--cp"),  # cp 1 is the reference, always run
    (["bench", "cp", "--cp", "two"], "--cp"),
    (["bench", "cp", "--methods", "zigzag"], "--methods"),
    (["bench", "cp", "--steps", "0"], "--steps"),
    (["bench", "cp", "--cp", "3"], "data.seq_len"),  # 4096 tokens do not cut into 6 chunks
    (["report", "{files}/missing.jsonl"], "report"),
    (["report", "{files}/tiny.txt"], "report"),  # not metrics lines
    (["report", "{files}/empty_dir"], "report"),  # no *.jsonl in it
    (["report", "{files}/tiny.txt", "--out", "{files}/three.bin"], "--out"),
    (["plan", "--gpus", "0"], "--gpus"),
    (["plan"], "--gpus"),  # required unless --calibrate
    (["bench", "plan", "--which", "some"], "--which"),
    (["bench", "plan", "--steps", "0"], "--steps"),
    (["bench", "topology", "--ratios", "18,x"], "--ratios"),
    (["bench", "topology", "--steps", "0"], "--steps"),
    (["plan", "--gpus", "8", "--gpu", "tpu"], "--gpu"),
    (["plan", "--gpus", "8", "--inter-node-gbps", "0"], "--inter-node-gbps"),
    (["plan", "--gpus", "8", "--gpu-memory-gb", "-24"], "--gpu-memory-gb"),
    (["plan", "--gpus", "8", "--gpu-memory-gb", "inf"], "--gpu-memory-gb"),
    (["plan", "--gpus", "8", "--gpu-tflops", "0"], "--gpu-tflops"),
    (["plan", "--gpus", "8", "--gpu-tflops", "1e-300"], "--gpu-tflops"),  # a 300-digit step
    (["plan", "--gpus", "8", "--intra-node-gbps", "1e300"], "--intra-node-gbps"),
    (["plan", "--gpus", "8", "--gpus-per-node", "3"], "--gpus-per-node"),
    (["plan", "--gpus", "8", "model.hf='{files}/empty_dir'"], "model.hf"),
    (["plan", "--gpus", "8", "--write-recipe", "{files}/empty_dir"], "--write-recipe"),
    (["plan", "--gpus", "3", "model.preset=tiny", "parallel.tp=2"], "plan"),  # no valid layout
    (["convert", "--to", "hf", "{files}/out", "{files}/empty_dir"], "CKPT"),  # no checkpoint
    (["convert", "--to", "hf", "{files}/tiny.txt", "{files}/ck_tiny"], "OUT"),  # a file
    (["convert", "--from", "hf", "{files}/empty_dir", "{files}/out"], "HF_DIR"),
    # Folders that were SafetensorError, JSONDecodeError and KeyError tracebacks
    *[(["convert", "--from", "hf", "{files}/" + name, "{files}/out"], "HF_DIR")
      for name in ("hf_cut", "hf_garbled_config", "hf_other_tensors", "hf_missing_tensor",
                   "hf_no_width")],
    (["data", "prepare", "{files}/tiny.txt", "{files}/o", "--tokenizer", "bpe:10"], "--tokenizer"),
    (["data", "prepare", "{files}/tiny.txt", "{files}/o", "--tokenizer", "{files}/t.json"],
     "--tokenizer"),
    (["data", "prepare", "{files}/nothing", "{files}/o", "--tokenizer", "bytes"], "SRC"),
    (["data", "prepare", "{files}/tiny.txt", "--tokenizer", "bytes"], "OUT"),
    (["data", "prepare", "{files}/tiny.txt", "{files}/ck_tiny", "--tokenizer", "bytes"], "OUT"),
    (["data", "prepare", "{files}/tiny.txt", "{files}/o", "--tokenizer", "bytes", "--workers",
      "0"], "--workers"),
    (["data", "prepare", "{files}/rows.jsonl", "{files}/o", "--tokenizer", "bytes"], "--field"),
    (["data", "prepare", "{files}/latin1.toml", "{files}/o", "--tokenizer", "bpe:300"], "SRC"),
    (["data", "prepare", "{files}/tiny.txt", "{files}/o", "--tokenizer", "{files}/bpe",
      "--field", "body", "--shard-tokens", "0"], "--shard-tokens"),
    (["data", "prepare", "{files}/text", "{files}/text/out", "--tokenizer", "bytes"], "OUT"),
    (["data", "prepare", "{files}/linked", "{files}/o", "--tokenizer", "bytes"], "SRC"),
    (["data", "prepare", "{files}/tiny.txt", "{files}/o", "--tokenizer", "{files}/tiny.txt"],
     "--tokenizer"),  # not a tokenizer
    (["data", "prepare", "{files}/bad.jsonl", "{files}/o", "--tokenizer", "bytes"], "SRC"),
    # A blank line, then a row whose text is a number: datasets fails opening it (52 lines)
    (["data", "prepare", "{files}/mixed.jsonl", "{files}/o", "--tokenizer", "bytes"], "SRC"),
    (["data", "prepare", "{files}/tiny.txt", "/proc/plait-o", "--tokenizer", "bytes"], "OUT"),
    # A launch checks sizes and a sample of ids; checksums are plait data verify's.
    (["data", "verify", "{files}/flipped"], "OUT"),  # fails its checksum
    (["data", "verify", "{files}/cut_shard"], "OUT"),
    (["data", "verify", "{files}/empty_dir"], "OUT"),
    (["data", "verify", "{files}/index_missing"], "OUT"),  # said "as prepared"
    (["data", "verify", "{files}/prepared", "--sample", "-1"], "--sample"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "latin1.toml").write_bytes("[train]\n# caf\xe9\nsteps = 3\n".encode("latin-1"))
    (root / "broken.toml").write_text("[train\nsteps = 3\n")
    (root / "sections.toml").write_text("[optimizer]\nlr = 1\n")
    (root / "empty.txt").write_text("")
    (root / "tiny.txt").write_text("x" * 100)
    (root / "empty_dir").mkdir()
    (root / "three.bin").write_bytes(b"abc")
    np.arange(100_001, dtype=np.uint16).astype(np.uint16).tofile(root / "odd.bin")
    with open(root / "odd.bin", "ab") as f:
        f.write(b"x")
    (np.arange(100_000) % 300).astype(np.uint16).tofile(root / "ids.bin")  # ids up to 299
    _prepared_corpora(root)
    ck = root / "ck_tiny" / "step-00000001"  # a checkpoint's marker and metadata: its model
    ck.mkdir(parents=True)
    (ck / "plait.json").write_text(json.dumps({"config": {"model": {"preset": "small"}},
                                              "contents": ["model"]}))
    (ck / "COMPLETE").write_text("")
    return root


def _prepared_corpora(root):
    """A good corpus (bytes: 2,800 ids, 43 windows of 65), one of 300 tokens, damaged copies."""
    import shutil

    from plait.data.tokenize_corpus import prepare

    text = root / "text"
    text.mkdir()
    for i in range(4):
        (text / f"{i}.txt").write_text(f"document {i}: " + "plait " * 115)
    prepare([str(text)], str(root / "prepared"), "bytes", progress=False)
    prepare([str(text)], str(root / "bpe"), "bpe:300", progress=False)
    for name in ("no_shard", "cut_shard", "flipped", "no_manifest_fields", "checksums_short",
                 "checksums_garbage"):
        shutil.copytree(root / "prepared", root / name)
    (root / "no_shard" / "shard-00000.bin").unlink()
    shard = root / "cut_shard" / "shard-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    shard = root / "flipped" / "shard-00000.bin"
    ids = bytearray(shard.read_bytes())
    ids[100] ^= 1
    shard.write_bytes(bytes(ids))
    (root / "no_manifest_fields" / "manifest.json").write_text('{"dtype": "uint16"}')
    np.save(root / "checksums_short" / "checksums.npy", np.zeros(0, dtype=np.uint32))
    (root / "checksums_garbage" / "checksums.npy").write_bytes(b"not an array")
    (root / "rows.jsonl").write_text('{"body": "a row"}\n')
    (root / "bad.jsonl").write_text('{"text": "a row"}\nnot json\n')
    (root / "mixed.jsonl").write_text('{"text": "a row"}\n\n{"text": 5}\n')
    (root / "linked").mkdir()
    (root / "linked" / "a.txt").write_text("a document")
    (root / "linked" / "elsewhere.txt").symlink_to(root / "tiny.txt")  # outside linked/
    _bad_manifests(root)
    _bad_hf_folders(root)
    for name, index in INDEXES.items():
        shutil.copytree(root / "prepared", root / name)
        with open(root / name / "documents.npy", "wb") as f:
            f.write(index) if isinstance(index, bytes) else np.save(f, index)
    shutil.copytree(root / "prepared", root / "index_missing")
    (root / "index_missing" / "documents.npy").unlink()
    shutil.copytree(root / "prepared", root / "index_folder")
    (root / "index_folder" / "documents.npy").unlink()
    (root / "index_folder" / "documents.npy").mkdir()


def _bad_hf_folders(root):
    """Hugging Face folders `plait convert --from hf` must refuse in one line: a weights file
    cut short, a config.json that is not JSON, tensors of another model, one tensor missing, a
    config.json without hidden_size (a KeyError traceback before)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16,
              "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 32,
              "rms_norm_eps": 1e-6}
    names = {"model.embed_tokens.weight": (64, 16), "model.norm.weight": (16,),
             "lm_head.weight": (64, 16), "model.layers.0.input_layernorm.weight": (16,),
             "model.layers.0.post_attention_layernorm.weight": (16,),
             **{f"model.layers.0.self_attn.{p}_proj.weight": (16, 16) for p in "qkvo"},
             **{f"model.layers.0.mlp.{p}_proj.weight": (32, 16) for p in ("gate", "up")},
             "model.layers.0.mlp.down_proj.weight": (16, 32)}
    for name, tensors in (("hf_cut", names), ("hf_garbled_config", names),
                          ("hf_other_tensors", {"x": (2,)}),
                          ("hf_missing_tensor", {k: v for k, v in names.items()
                                                 if k != "model.norm.weight"})):
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        save_file({k: torch.zeros(v) for k, v in tensors.items()},
                  str(folder / "model.safetensors"))
    shutil.copytree(root / "hf_missing_tensor", root / "hf_remote")
    (root / "hf_remote" / "config.json").write_text(json.dumps(
        {**config, "auto_map": {"AutoModelForCausalLM": "mine.Model"}}))
    data = (root / "hf_cut" / "model.safetensors").read_bytes()
    (root / "hf_cut" / "model.safetensors").write_bytes(data[: len(data) // 2])
    (root / "hf_garbled_config" / "config.json").write_text("{not json")
    shutil.copytree(root / "hf_other_tensors", root / "hf_unplanned")  # a family with no plan
    (root / "hf_unplanned" / "config.json").write_text(json.dumps(
        {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "hidden_size": 16,
         "n_layer": 1, "n_head": 2, "vocab_size": 64}))
    shutil.copytree(root / "hf_missing_tensor", root / "hf_no_width")
    (root / "hf_no_width" / "config.json").write_text(json.dumps(
        {k: v for k, v in config.items() if k != "hidden_size"}))


def _bad_manifests(root):
    import shutil

    good = json.loads((root / "prepared" / "manifest.json").read_text())
    for name, change in MANIFESTS.items():
        folder = root / f"manifest_{name}"
        shutil.copytree(root / "prepared", folder)
        (folder / "manifest.json").write_text(json.dumps(change(good)))


def test_the_table_is_large():
    assert len(BAD_INPUT) >= 80


@pytest.mark.parametrize("argv,field", BAD_INPUT, ids=[f for _, f in BAD_INPUT])
def test_bad_input_exits_2_with_one_line(argv, field, files, no_launch, capsys):
    argv = [a.replace("{files}", str(files)) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"plait: error: {field}") or f"argument {field}" in err, err


@pytest.mark.parametrize("argv,field", OTHER_BAD_INPUT, ids=[" ".join(a[:2]) + f" {f}"
                                                             for a, f in OTHER_BAD_INPUT])
def test_other_commands_refuse_bad_input_in_one_line(argv, field, files, no_launch, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([a.replace("{files}", str(files)) for a in argv])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith(f"plait: error: {field}"), err
    assert out == "", out  # no progress line before the refusal


def test_a_table_that_does_not_parse_is_not_said_to_fail_after_0_rows(files, no_launch, capsys):
    """datasets reads a JSON-lines file in batches: its error names the line ("in row 1") while
    no row has reached plait yet; the refusal said "after 0 row(s) (... in row 1)"."""
    with pytest.raises(SystemExit):
        cli.main(["data", "prepare", f"{files}/bad.jsonl", f"{files}/o", "--tokenizer", "bytes"])
    err = capsys.readouterr().err
    assert "does not read as json: JSON parse error" in err and "row(s)" not in err, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: no read-only folder")
def test_a_read_only_metrics_folder_is_refused(tmp_path, no_launch, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--metrics", str(folder / "m.jsonl")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("plait: error: --metrics")


def test_bad_input_from_a_real_process():
    """The same through the installed entry point: status 2, one line on stderr, nothing else."""
    proc = subprocess.run(
        [sys.executable, "-m", "plait", "train", "parallel.tp=5", "parallel.dp=1", "--nproc", "5"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "plait: error: parallel.tp: tp=5 must divide n_heads=6, n_kv_heads=2, ffn_dim=512, "
        "vocab_size=256"
    ]


# Every refusal in a process of its own, forked from one that imported plait's command line and
# nothing else, so that what a refusal imports is its own (a new interpreter per row took 44 s of
# the suite). Each row: [status, seconds, stderr + a last line saying whether torch was imported].
REFUSER = r"""
import json, os, sys, time, traceback
from plait import cli
for line in sys.stdin:
    argv = json.loads(line)
    read, write = os.pipe()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        os.dup2(write, 2)
        status = 0
        try:
            cli.main(argv)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stderr.write("\n" + ("torch" if "torch" in sys.modules else "no torch"))
        sys.stderr.flush()
        os._exit(status)
    os.close(write)
    with os.fdopen(read, errors="replace") as err:
        said = err.read()
    _, status = os.waitpid(pid, 0)
    print(json.dumps([os.waitstatus_to_exitcode(status), time.perf_counter() - start, said]),
          flush=True)
"""
STARTUP = "from plait import cli"  # what a user's refusal adds: a new interpreter, that import


def _may_import_torch(argv: list[str], field: str) -> bool:
    """The refusals whose check may read through torch or a library that imports it; every other
    one is made from the configuration, the file system and numpy alone."""
    return (field == "plan"  # the search found no layout: it priced them
            or argv[0] == "bench" and not field.startswith("--"))  # a bench's own layouts


def test_refusals_import_no_torch_and_say_how_long_they_take(files, say):
    """Every bad input of both tables, each in a process of its own (`REFUSER`): status 2.
    Importing torch takes seconds here, most of a refusal's time, so those that need no torch
    must not import it. The median time is printed, with what a new interpreter adds (timings
    are never asserted)."""
    rows = [(["train", *a], f) for a, f in BAD_INPUT] + OTHER_BAD_INPUT
    argvs = "".join(json.dumps([a.replace("{files}", str(files)) for a in argv]) + "\n"
                    for argv, _ in rows)
    proc = subprocess.run([sys.executable, "-c", REFUSER], input=argvs, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(rows)
    assert [(status, row) for (status, _, _), row in zip(results, rows, strict=True)
            if status != 2] == []
    imported = [row for row, (_, _, said) in zip(rows, results, strict=True)
                if said.splitlines()[-1] == "torch"]
    assert [row for row in imported if not _may_import_torch(*row)] == []
    startup = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", STARTUP], check=True, timeout=60)
        startup.append(time.perf_counter() - start)
    seconds = sorted(t for _, t, _ in results)
    slowest = sorted(zip((t for _, t, _ in results), rows, strict=True), key=lambda x: -x[0])[:3]
    say(f"{len(rows)} bad inputs refused: median {statistics.median(seconds):.2f} s, 90th "
        f"percentile {seconds[int(0.9 * len(seconds))]:.2f} s, slowest {seconds[-1]:.2f} s, "
        f"each after a new interpreter has imported plait's command line "
        f"({statistics.median(startup):.2f} s) ({len(imported)} import torch: layouts to "
        "price); the slowest: " + "; ".join(f"{' '.join(row[0])[:60]} {t:.2f} s"
                                            for t, row in slowest))


def test_the_compile_backends_named_without_torch_are_the_installed_torchs():
    """`train.compile_backend` is checked against a list kept in plait (importing torch._dynamo
    to ask takes seconds): the installed torch must list no backend that the list lacks, or a
    valid name would be refused."""
    from torch._dynamo import list_backends

    assert set(list_backends(exclude_tags=())) <= set(compile_backends())
    assert "inductor" in compile_backends() and "aot_eager" in compile_backends()


def test_context_parallel_refusals_name_the_fix():
    with pytest.raises(ConfigError, match=r"data.seq_len: ring attention cuts each sequence "
                       r"into 2 x cp = 4 equal chunks .*: 30 is not a multiple of 4"):
        validate(load_config(None, ["parallel.cp=2", "data.seq_len=30"]), 2)
    with pytest.raises(ConfigError, match=r"parallel.cp: Ulysses splits the 6 attention heads "
                       r".* use cp_method = 'ring'"):
        validate(load_config(None, ["parallel.cp=4", "parallel.cp_method=ulysses",
                                     "model.preset='small'"]), 4)


def test_dp_0_and_a_lone_local_addr_are_refused_in_their_own_words(no_launch, capsys):
    """parallel.dp=0 means "the rest of the world": a refusal that printed "dp=0 * tp=4 must
    equal the world size 2" asked for a product that dp=0 never is; --local-addr alone was
    refused as "--nnodes ... got None"."""
    with pytest.raises(ConfigError, match=r"^parallel: pp=1 \* cp=1 \* ep=1 \* tp=4 = 4 must "
                       r"divide the world size 2 \(parallel.dp=0 takes the rest\)"):
        validate(load_config(None, ["parallel.dp=0", "parallel.tp=4"]), 2)
    with pytest.raises(SystemExit):
        cli.main(["train", "--local-addr", "127.0.0.1"])
    err = capsys.readouterr().err
    assert err.startswith("plait: error: --nnodes: --local-addr is for a job across nodes") \
        and "None" not in err, err


def test_an_output_path_made_meanwhile_by_another_node_is_creatable_and_left_alone(tmp_path):
    """Each node's launcher checks the same --metrics path; one made it between the other's
    look and its try (seen: 'cannot be created (File exists)' on the second node)."""
    from plait.config.paths import creatable

    target = tmp_path / "runs" / "m.jsonl"
    target.parent.mkdir()
    target.write_text("the other node's")
    assert creatable(target, tmp_path, folder=False) is None
    assert target.read_text() == "the other node's"


def test_the_llama_classes_a_wrap_policy_can_name_are_the_models():
    """`parallel.wrap` is checked before launch against `llama_plan.MODULE_CLASSES`, without
    torch: they are the classes of a built Llama's modules, dense and mixture of experts, less
    the root and its containers (never chosen: `parallel/wrap.py`)."""
    from plait.config.schema import ModelConfig
    from plait.model.llama_plan import MODULE_CLASSES
    from plait.parallel.wrap import callable_

    built = set()
    for overrides in ({}, {"moe_experts": 4}):
        model = ModelConfig(overrides=overrides).build(0, "meta")
        built |= {type(m).__name__ for m in model.modules() if m is not model and callable_(m)}
    assert built == set(MODULE_CLASSES)
