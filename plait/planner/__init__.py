"""`plait plan`: which layout to train a model with on a cluster, priced before any GPU-hour.

Every candidate layout (tp, pp, dp, ZeRO stage, hybrid sharding, micro-batches, schedule,
checkpointing, sequence parallelism) that `validate` accepts is priced per pipeline stage with the
engine's own formulas, run on a `meta` model in one process as `--dry-run` does:

    model state    `predict.cost.state_bytes`        (asserted equal to real runs)
    collectives    `predict.cost.step_traffic`       (asserted equal to real runs)
    activations    `predict.activations`             (asserted equal to real runs)
                   a Hugging Face model's: its stage's step traced on fake tensors
                   (`plait.predict.trace`, its own operations), FLOPs too

so a plan's `memory_bytes` and `comm_bytes` are, for a configuration that runs, that run's
`model_state_bytes`, `activation_bytes` and `comm_bytes` on rank 0. Time is a model: on a GPU the
compute from shapes (`gemm.py`: each linear layer's matmuls by their sizes, attention by its
length, elementwise work and the optimizer by the bytes they move, as the engine does them:
`hardware.Engine`), on this CPU its calibrated matmul rate and overheads; each collective by
alpha-beta on the links its group crosses (tp innermost on the mesh, so within a node first);
tensor- and pipeline-parallel traffic on the critical path, data-parallel reductions hidden
behind backward (ZeRO-3: the whole step) as far as it lasts, ZeRO-1/2's all-gather after the
optimizer step exposed; the schedule's simulated bubble stretching the pipelined part. A plan
fits when its worst stage's peak model state during the step (ZeRO-3's gathered units and the
gradients in flight at their most, `cost.state_bytes`' "peak") and activations stay under 95% of
the device's memory (the rest: the CUDA context, allocator fragmentation, temporaries).
"""

# The package holds no code of its own: `plait plan` refuses a bad option (hardware.py) before
# the pricing (price.py) and its imports (torch) load.
