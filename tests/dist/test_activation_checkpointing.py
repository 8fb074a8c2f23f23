"""Activation checkpointing buys what it should, measured exactly with saved-tensor hooks.

For L = 2 and 4 blocks, the peak bytes saved for backward are `outside + L * per_block`: the part
outside the blocks (embedding, head, loss) is the same for every mode, and per block
- full checkpointing keeps exactly one activation, the block's input;
- selective keeps every matmul's inputs and outputs;
- none keeps more than selective;
each exactly what `plait.predict.activations.block_bytes` says.
Checkpointing changes no result: the matrix (test_compositions) trains with it and equals one
process.
"""

import pytest
from harness import run_world
from training import run_steps, tiny_config

from plait.predict.activations import block_bytes


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
    assert per_block["full"] == A
    assert per_block["none"] > per_block["selective"] > per_block["full"]
    for mode, kept in per_block.items():
        mode_cfg = tiny_config(f"train.activation_checkpointing={mode}")
        assert kept == block_bytes(mode_cfg, 1, cfg.train.global_batch), mode
