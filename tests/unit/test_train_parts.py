import math

import pytest
import torch

from plait.config.schema import DataConfig, TrainConfig
from plait.data.batches import ByteTokenizer, TokenData
from plait.model import PRESETS, build_model, count_params
from plait.model.shape import Shape
from plait.optim.build import lr_at, peak_lr
from plait.train.metrics import flops_per_token
from plait.train.verify import Verdict


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
    # The validation split is whole files (documents) from the end, near the last 5% of tokens.
    assert data.split in data.corpus.starts


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "def plait(): return 'ß'"
    assert tok.decode(tok.encode(text)) == text


def test_bin_source(tmp_path):
    ids = torch.randint(0, 50_000, (4096,), dtype=torch.int32).numpy().astype("uint16")
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    d = TokenData(DataConfig(source=str(path), seq_len=16), seed=0)
    assert d.corpus.tokens == 4096 and d.split == 4096 - int(4096 * 0.05)  # one document
    x, y = d.batch(0, 4)
    for row, window in zip(x, d.windows(0, 4), strict=True):
        expected = ids[window * 16 : window * 16 + 16].astype("int64")
        assert torch.equal(row, torch.from_numpy(expected))


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
    shape = Shape.of_llama(args)
    assert flops_per_token(shape, n, 64) == expected
    assert math.isclose(6 * n, flops_per_token(shape, n, 0), rel_tol=0.2)


def test_the_tracer_records_only_while_on_and_hands_events_over_once():
    from plait.comm.trace import EventTracer, pipeline_spans
    from plait.train.tracing import _by_step, traced_steps

    tracer = EventTracer()
    with tracer.span("before"):
        pass
    assert tracer.events == []  # off: nothing recorded
    tracer.start(rank=3)
    with tracer.span("step 1", "step", step=1):
        tracer.complete("F0", "pipeline", 10.0, 10.5, kind="F", microbatch=0, chunk=0)
        tracer.overlapping("all_reduce", "collective", 10.1, 10.9, ranks=[2, 3])
    tracer.pause()
    with tracer.span("after"):
        pass
    events = tracer.take()
    assert [e["name"] for e in events] == ["F0", "all_reduce", "all_reduce", "step 1"]
    assert [e["ph"] for e in events] == ["X", "b", "e", "X"]
    assert {e["pid"] for e in events} == {3} and tracer.take() == []
    begin, end = events[1:3]
    assert begin["id"] == end["id"] and end["ts"] - begin["ts"] == pytest.approx(0.8e6)
    assert pipeline_spans(events) == [("F", 0, 0, pytest.approx(events[0]["ts"] / 1e6),
                                       pytest.approx(events[0]["ts"] / 1e6 + 0.5))]
    # Steps are told apart by their spans; the first step is not traced unless it is the only.
    assert list(traced_steps(10, 2)) == [1, 2] and list(traced_steps(1, 3)) == [0]
    assert list(traced_steps(3, 5)) == [1, 2]
    assert set(_by_step(events)) == {1}


def test_verify_judges_a_near_zero_gradient_against_the_models_scale():
    """A group whose largest gradient is rounding (OPT's key bias under ZeRO-3 bf16: 1.28e-7,
    difference 1.26e-7, once "relative 0.99, FAILED") is judged against `tolerance` of the
    model's largest gradient; a real difference in a small group still fails, as does one in a
    big group."""
    groups = {"layers.*.fc.weight": (1e-3, 1.0), "layers.*.k_proj.bias": (1.26e-7, 1.28e-7)}
    assert Verdict(2.0, 2.0, groups, 2e-2).failures() == []
    small = {**groups, "layers.*.norm.bias": (1e-3, 2e-3)}  # half its own largest gradient
    assert Verdict(2.0, 2.0, small, 2e-2).failures() == ["layers.*.norm.bias"]
    big = {**groups, "layers.*.fc.weight": (0.1, 1.0)}
    assert Verdict(2.0, 2.0, big, 2e-2).failures() == ["layers.*.fc.weight"]
    assert "6.30e-06" in Verdict(2.0, 2.0, groups, 2e-2).table()  # 1.26e-7 / (0.02 x 1.0)


def test_a_half_embeddings_gradient_on_the_cpu_is_summed_in_fp32():
    """`parallel/embedding_grad.py`: 8,192 tokens over 8 rows of a bf16 table; the weight's
    gradient is the fp32 sum of the rows' gradients rounded once to bf16 (torch's CPU kernel
    rounds at every addition: 6% off here). The lookup itself is `F.embedding`'s, and an
    `nn.Embedding` swapped to it gives the same forward, and the same gradient in fp32."""
    from torch import nn

    from plait.parallel.embedding_grad import embedding, sum_embedding_grads_in_fp32

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 8, (4, 2048), generator=gen)
    grad = torch.randn(4, 2048, 16, generator=gen).bfloat16()
    weight = torch.randn(32, 16, generator=gen).bfloat16().requires_grad_()
    out = embedding(tokens, weight)
    assert torch.equal(out, torch.nn.functional.embedding(tokens, weight))
    out.backward(grad)
    exact = torch.zeros(32, 16).index_add_(0, tokens.reshape(-1), grad.reshape(-1, 16).float())
    assert torch.equal(weight.grad, exact.bfloat16())
    table = nn.Embedding(32, 16, padding_idx=3)
    sum_embedding_grads_in_fp32(table)
    plain = nn.Embedding(32, 16, padding_idx=3)
    plain.load_state_dict(table.state_dict())
    table(tokens).backward(grad.float())
    plain(tokens).backward(grad.float())
    torch.testing.assert_close(table.weight.grad, plain.weight.grad, rtol=1e-6, atol=1e-6)
    assert table.weight.grad[3].abs().sum() == 0  # the padding row takes no gradient
