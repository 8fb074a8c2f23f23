"""The values a configuration key may take, where they are a closed list. The engines key their
implementations by these names; keeping the names here, in a module that imports nothing, lets
the checks refuse a misspelt one without importing an engine (or torch) first."""

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1")  # parallel.pp_schedule
CP_METHODS = ("ring", "ulysses")  # parallel.cp_method
COMPRESSIONS = ("none", "fp16", "bf16", "int8", "topk", "powersgd", "sign")  # parallel.compression
WITH_ERROR_FEEDBACK = ("topk", "powersgd", "sign")  # the lossy ones that keep a residual
ROUTERS = ("token_choice", "expert_choice")  # model.moe_router
HALF_PRECISIONS = ("bf16", "fp16")  # train.precision, besides "fp32"
PARAM_DTYPES = ("auto", "fp32", *HALF_PRECISIONS)  # train.param_dtype


def held_precision(precision: str, param_dtype: str, zero: int) -> str:
    """The dtype the parameters are held and computed in ("fp32", "bf16", "fp16"), from
    `train.precision`, `train.param_dtype` and `parallel.zero`: "auto" holds them in the half
    precision under ZeRO and in fp32 otherwise (autocast over them); a half dtype holds them in
    it under every engine, with fp32 masters the optimizer steps."""
    if param_dtype == "auto":
        return precision if zero and precision in HALF_PRECISIONS else "fp32"
    return param_dtype


OPTIMIZERS = ("adamw", "muon", "sgd")  # train.optimizer
MUON_ADJUST_LR = ("match_rms_adamw", "original")  # train.muon_adjust_lr

# train.compile_backend: the backends torch's own registry holds (`torch._dynamo.list_backends(
# exclude_tags=())` on torch 2.13; a test holds the installed torch to this list), besides those a
# package registers under the entry-point group torch reads. Named here so that a misspelt one is
# refused without importing torch._dynamo (seconds).
COMPILE_BACKENDS = (
    "aot_eager", "aot_eager_decomp_partition", "aot_eager_decomp_partition_crossref",
    "aot_eager_decomp_partition_with_mode", "aot_eager_default_partitioner", "aot_ts",
    "cudagraphs", "dynamo_accuracy_minifier_backend", "dynamo_minifier_backend", "eager",
    "eager_debug", "eager_noexcept", "inductor", "invoke_subgraph",
    "non_leaf_compile_error_TESTING_ONLY", "openxla", "openxla_eval", "pre_dispatch_eager",
    "relu_accuracy_error_TESTING_ONLY", "relu_compile_error_TESTING_ONLY",
    "relu_runtime_error_TESTING_ONLY", "ts", "tvm")
COMPILE_BACKEND_ENTRY_POINTS = "torch_dynamo_backends"
