"""Activation checkpointing buys what it should, measured exactly with saved-tensor hooks.

For L = 2 and 4 blocks, the peak bytes saved for backward are `outside + L * per_block`: the part
outside the blocks (embedding, head, loss) is the same for every mode, and per block
- full checkpointing keeps exactly one activation, the block's input;
- selective keeps every matmul's inputs and outputs (plait.parallel.cost.block_activations);
- none keeps more than selective.
Checkpointing changes no result: the matrix (test_compositions) trains with it and equals one
process.
"""

import pytest
from harness import run_world
from training import run_steps, tiny_config

from plait.parallel.cost import block_activations


@pytest.fixture(scope="module")
def measured():
    def peak(layers, mode):
        cfg = tiny_config(f"model.n_layers={layers}", f"train.activation_checkpointing={mode}")
        return run_world(run_steps, 1, cfg, steps=1)[0]["activation_bytes"]

    return {(layers, mode): peak(layers, mode) for layers in (2, 4)
            for mode in ("none", "selective", "full")}


def test_checkpointing_keeps_what_it_should(measured):
    cfg = tiny_config()
    args = cfg.model.args()
    A = cfg.train.global_batch * cfg.data.seq_len * args.dim * 4  # one fp32 activation, bytes
    per_block = {m: (measured[4, m] - measured[2, m]) / 2 for m in ("none", "selective", "full")}
    outside = {m: measured[2, m] - 2 * per_block[m] for m in per_block}
    assert len(set(outside.values())) == 1, outside  # checkpointing touches only the blocks
    assert per_block["full"] == A * block_activations(args, "full") == A
    assert per_block["selective"] == A * block_activations(args, "selective")
    assert per_block["none"] > per_block["selective"] > per_block["full"]
