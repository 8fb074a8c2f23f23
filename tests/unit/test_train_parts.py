import math

import pytest
import torch

from plait.config import DataConfig, TrainConfig
from plait.model import PRESETS, build_model, count_params
from plait.train.data import ByteTokenizer, TokenData
from plait.train.metrics import flops_per_token
from plait.train.optim import lr_at, peak_lr


@pytest.fixture(scope="module")
def data():
    return TokenData(DataConfig(seq_len=32, max_bytes=200_000), seed=5)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_batches_do_not_depend_on_the_number_of_ranks(data, ranks):
    for step in (0, 1, 17):
        whole_x, whole_y = data.batch(step, 16)
        parts = [data.batch(step, 16, rank, ranks) for rank in range(ranks)]
        assert torch.equal(torch.cat([x for x, _ in parts]), whole_x)
        assert torch.equal(torch.cat([y for _, y in parts]), whole_y)
    assert not torch.equal(data.batch(0, 16)[0], data.batch(1, 16)[0])


def test_targets_are_inputs_shifted_and_splits_disjoint(data):
    x, y = data.batch(3, 4)
    assert x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    vx, _ = data.val_batch(0, 4)
    assert torch.equal(vx, data.val_batch(0, 4)[0])  # fixed
    assert len(data.val) == int((len(data.train) + len(data.val)) * 0.05)


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "def plait(): return 'ß'"
    assert tok.decode(tok.encode(text)) == text


def test_bin_source(tmp_path):
    ids = torch.randint(0, 50_000, (4096,), dtype=torch.int32).numpy().astype("uint16")
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    d = TokenData(DataConfig(source=str(path), seq_len=16), seed=0)
    assert torch.equal(torch.cat([d.train, d.val]), torch.from_numpy(ids.astype("int64")))


def test_lr_schedule_warmup_cosine_and_linear_scaling():
    cfg = TrainConfig(steps=110, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)  # peak at the end of warm-up
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(109, cfg) == pytest.approx(1e-4)  # floor at the last step
    mid = 10 + (110 - 10 - 1) / 2
    assert lr_at(int(mid), cfg) < 0.56e-3 < lr_at(int(mid) - 1, cfg)
    scaled = TrainConfig(lr=1e-3, global_batch=256, base_batch=32, lr_scaling="linear")
    assert peak_lr(scaled) == pytest.approx(8e-3)


def test_flops_per_token_is_6n_plus_attention():
    args = PRESETS["tiny"]
    n = count_params(build_model(args, seed=0))
    expected = 6 * (n - args.vocab_size * args.dim) + 12 * args.n_layers * 64 * args.dim
    assert flops_per_token(args, n, 64) == expected
    assert math.isclose(6 * n, flops_per_token(args, n, 0), rel_tol=0.2)
