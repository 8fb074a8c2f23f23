"""Batches as the model takes them, through the Python API (`job.step(batch, optimizer)`).

- A transformers Llama folder loaded with `plait.load_hf`, given dicts of `input_ids`,
  `attention_mask` (left padding in two rows) and `labels` (-100 at the padding),
  computes its own loss (transformers' `loss_function`) at dp2 x tp2 and equals the transformers
  model itself trained in one process on the same global batches (`LlamaForCausalLM(**batch)
  .loss`): 3 AdamW steps, losses relative 1e-5, parameters by `assert_params_close` (tp shards
  against the same slice of the reference). Under tp the vocabulary-split head all-gathers its
  logits for the model's loss. Each dp rank's rows hold the same number of labelled tokens: the
  model's loss is a mean over its micro-batch's labelled tokens, and the mean of equal-count means
  is the global mean (with unequal counts it is not: transformers' own accumulation caveat).
- A module whose forward takes several tensors and returns its own scalar loss trains under
  ZeRO-3 from a tuple batch equal to one process.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_world
from hf_models import write_model
from torch import nn
from training import assert_params_close

import plait

STEPS, BATCH, SEQ, LR = 3, 8, 16, 3e-3


def _batches(vocab: int):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(vocab, (BATCH, SEQ), generator=g)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        # Left padding (so that the mask changes what the other tokens see): the first 4
        # positions of rows 3 and 7, one such row in each dp rank's half of the batch (equal
        # labelled-token counts per rank).
        mask[3, :4] = mask[7, :4] = 0
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _reference(folder):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in _batches(model.config.vocab_size):
        optimizer.zero_grad()
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _plait(folder):
    plait.init()
    model = plait.load_hf(folder)
    job = plait.prepare(model, None, plait.ParallelConfig(tp=2))
    optimizer = torch.optim.AdamW(job.parameters(), lr=LR)
    losses = [job.step(batch, optimizer) for batch in _batches(model.args.vocab_size)]
    held = {n: p.detach().clone() for n, p in job.model.named_parameters()}
    return losses, held, job.parallelized.record


def test_hf_dict_batches_with_their_own_loss_at_dp2_tp2_equal_transformers(tmp_path):
    from plait.model.families import family_of
    from plait.model.hf import hf_name

    folder = write_model(tmp_path / "llama", "llama")
    want_losses, want = _reference(folder)
    for losses, held, record in run_world(_plait, 4, folder):
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for name, p in held.items():
            whole = want[hf_name(name, family_of("LlamaForCausalLM"))]
            shard = record.params[name].shards.get("tp")
            if shard is not None and shard.dim is not None:
                whole = whole.chunk(shard.count, dim=shard.dim)[shard.index]
            assert_params_close(p, whole, name, lr=LR, steps=STEPS)


class OwnLoss(nn.Module):
    """Two inputs and a target in, its own loss out."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(3, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x, z, y):
        return nn.functional.cross_entropy(self.out(torch.tanh(self.a(x) + self.b(z))), y)


def _tuples():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g),
             torch.randint(4, (BATCH,), generator=g)) for _ in range(STEPS)]


def _own_loss_zero3():
    plait.init()
    torch.manual_seed(0)
    job = plait.prepare(OwnLoss(), None, plait.ParallelConfig(zero=3, microbatches=2))
    optimizer = torch.optim.AdamW(job.parameters(), lr=LR)
    return [job.step(batch, optimizer) for batch in _tuples()], job.full_state_dict()


def test_a_tuple_batch_and_the_models_own_loss_under_zero3_equal_one_process():
    torch.manual_seed(0)
    model = OwnLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    want_losses = []
    for batch in _tuples():
        optimizer.zero_grad()
        loss = model(*batch)
        loss.backward()
        optimizer.step()
        want_losses.append(loss.item())
    for losses, got in run_world(_own_loss_zero3, 2):
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for name, p in model.named_parameters():
            assert_params_close(got[name], p.detach(), name, lr=LR, steps=STEPS)
