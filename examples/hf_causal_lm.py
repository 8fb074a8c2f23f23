"""A Hugging Face causal LM from a local folder, trained at dp x tp x pp through the Python API.

    plait run --nproc 8 --preload transformers examples/hf_causal_lm.py [--model DIR] [--steps 6]

(`--preload transformers`: imported once before the 8 workers are forked, not by each.)

The folder is what transformers' `save_pretrained` writes; without --model a tiny random Llama is
written to a temporary folder first (nothing is downloaded). plait runs the transformers modules
themselves; the family's plan (`plait/model/hf.py`) tells tp where to split and pp where to cut.
The data: the bytes of Python's own json package, one token per byte (the tiny model's
vocabulary is 256).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import plait


def tiny_llama() -> Path:
    """A random 4-layer Llama written by save_pretrained into a temporary folder: rank 0 writes
    it and tells the others where."""
    where = [None]
    if dist.get_rank() == 0:
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging

        logging.disable_progress_bar()
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256)
        where[0] = tempfile.mkdtemp(prefix="plait-tiny-llama-")
        LlamaForCausalLM(config).save_pretrained(where[0])
    dist.broadcast_object_list(where, src=0)
    return Path(where[0])


def batches(seq_len: int, rows: int, steps: int):
    """(inputs, targets) global batches of byte windows, the same on every rank."""
    text = b"".join(p.read_bytes() for p in sorted(Path(json.__file__).parent.glob("*.py")))
    tokens = torch.tensor(list(text), dtype=torch.long)
    order = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(len(tokens) - seq_len - 1, (rows,), generator=order)
        windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
        yield windows[:, :-1], windows[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a Hugging Face model folder (default: a tiny Llama)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    args = parser.parse_args()

    device = plait.init()
    folder = Path(args.model) if args.model else tiny_llama()
    model = plait.load_hf(folder, device=device)
    if not args.model:
        dist.barrier()  # every rank has read it
        if dist.get_rank() == 0:
            shutil.rmtree(folder)
    # dp takes what tp x pp leave of the world; pp runs 4 micro-batches per step (1F1B).
    parallel = plait.ParallelConfig(tp=args.tp, pp=args.pp, microbatches=4, zero=1)
    job = plait.prepare(model, parallel=parallel)  # loss: vocabulary-parallel cross-entropy
    optimizer = torch.optim.AdamW(job.parameters(), lr=3e-3)
    for step, (inputs, targets) in enumerate(batches(64, 16, args.steps)):
        loss = job.step(*job.local(inputs.to(device), targets.to(device)), optimizer,
                        grad_clip=1.0)
        plait.print0(f"step {step:3d}  loss {loss:.4f}")
    plait.finish()


if __name__ == "__main__":
    main()
