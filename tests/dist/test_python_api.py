"""The Python API on a module that is not a transformer: the example's convolutional classifier
with BatchNorm (`examples/digits_zero3.py`), 2 ranks, global batch 16, 4 AdamW steps.

- Under DDP (`zero=0`) it equals torch's own `DistributedDataParallel` on the same run, BatchNorm
  in training mode: each rank normalises by its own rows' statistics in both, and both broadcast
  the running statistics from rank 0 before each forward.
- Under ZeRO-1/2/3 (ZeRO-3 with each ConvBlock a unit, and again with units chosen by parameter
  count) it equals one process training on the global batch, BatchNorm in eval mode: in training
  mode the statistics of 8 rows per rank are not those of 16 by design.
- A degree that needs a model plan is refused, naming the module.

Tolerance: losses relative 1e-5; parameters by `assert_params_close` (float32, AdamW: the
reductions sum in another order than one process's backward; the reasons are in the helper).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_world
from torch.nn.parallel import DistributedDataParallel
from training import assert_params_close

import plait

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS, BATCH, LR = 4, 16, 3e-3


def _example():
    spec = importlib.util.spec_from_file_location("digits_zero3", EXAMPLES / "digits_zero3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


digits = _example()


def _batches():
    x, y, _, _ = digits.digits()
    order = torch.Generator().manual_seed(1)
    return [(x[r], y[r]) for r in (torch.randint(len(x), (BATCH,), generator=order)
                                   for _ in range(STEPS))]


def _model(train_mode: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = digits.DigitsNet(width=8)
    return model.train(train_mode)


def _plait_run(parallel: plait.ParallelConfig, wrap, train_mode: bool):
    plait.init()
    job = plait.prepare(_model(train_mode), F.cross_entropy, parallel, wrap=wrap)
    optimizer = torch.optim.AdamW(job.parameters(), lr=LR)
    losses = [job.step(*job.local(x, y), optimizer, grad_clip=1.0) for x, y in _batches()]
    buffers = {n: b.clone() for n, b in job.model.named_buffers()}
    return losses, job.full_state_dict(), buffers


def _torch_ddp_run():
    model = DistributedDataParallel(_model(True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    rank, losses = torch.distributed.get_rank(), []
    for x, y in _batches():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x.chunk(2)[rank]), y.chunk(2)[rank])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / 2)
    state = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return losses, state, {n: b.clone() for n, b in model.module.named_buffers()}


def _both_ddp():
    return _plait_run(plait.ParallelConfig(), None, True), _torch_ddp_run()


def _one_process(optimizers_of=lambda model: [torch.optim.AdamW(model.parameters(), lr=LR)],
                 build=lambda: _model(False), after_backward=lambda model: None):
    """One process on the global batches, clipped as the jobs are: losses and parameters.
    `optimizers_of(model)`: the optimizers that step it (AdamW by default); `build()` the model;
    `after_backward(model)` runs before the clipping."""
    model = build()
    optimizers = optimizers_of(model)
    losses = []
    for x, y in _batches():
        for o in optimizers:
            o.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        after_backward(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in optimizers:
            o.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same(got, want, what: str):
    got_losses, got_params = got[:2]
    want_losses, want_params = want[:2]
    assert got_losses == pytest.approx(want_losses, rel=1e-5), what
    assert got_params.keys() == want_params.keys(), what
    for name, p in want_params.items():
        assert_params_close(got_params[name], p, f"{what}: {name}", lr=LR, steps=STEPS)


def test_ddp_equals_torch_ddp_with_batchnorm_in_training_mode():
    for (ours, theirs) in run_world(_both_ddp, 2):
        _assert_same(ours, theirs, "plait DDP vs torch DDP")
        for name, b in theirs[2].items():  # running statistics: rank 0's, on every rank
            torch.testing.assert_close(ours[2][name], b, rtol=1e-5, atol=1e-6, msg=name)


ZERO = {
    "zero1": (plait.ParallelConfig(zero=1), None),
    "zero2": (plait.ParallelConfig(zero=2), None),
    "zero3 units by class": (plait.ParallelConfig(zero=3),
                             plait.WrapPolicy(classes=(digits.ConvBlock,))),
    "zero3 units by size": (plait.ParallelConfig(zero=3), plait.WrapPolicy(min_params=500)),
}


@pytest.fixture(scope="module")
def one_process():
    return _one_process()


@pytest.mark.parametrize("name", list(ZERO))
def test_zero_equals_one_process(name, one_process):
    parallel, wrap = ZERO[name]
    for got in run_world(_plait_run, 2, parallel, wrap, False):
        _assert_same(got, one_process, name)


def _compiled_run(parallel: plait.ParallelConfig, wrap):
    plait.init()
    job = plait.prepare(_model(False), F.cross_entropy, parallel, wrap=wrap, compile=True,
                        compile_backend="aot_eager")
    optimizer = torch.optim.AdamW(job.parameters(), lr=LR)
    losses = [job.step(*job.local(x, y), optimizer, grad_clip=1.0) for x, y in _batches()]
    from plait.parallel.compile import compiled_graphs

    return losses, job.full_state_dict(), compiled_graphs()


def test_a_modules_units_compile_and_train_as_one_process(one_process):
    """`compile=True` on a module with no plan: the units `wrap` chooses (its conv blocks) each
    compiled (a torch.compile capture, "aot_eager"), under ZeRO-3, equal to one process eager;
    with no unit to compile, asking for it is refused."""
    parallel, wrap = ZERO["zero3 units by class"]
    for got in run_world(_compiled_run, 2, parallel, wrap):
        _assert_same(got, one_process, "compiled ZeRO-3 units")
        assert got[2] >= 1
    for message in run_world(_refused_compile, 1):
        assert "train.compile: no block to compile" in message


def _refused_compile():
    plait.init()
    with pytest.raises(ValueError) as caught:
        plait.prepare(_model(False), F.cross_entropy, compile=True)
    return str(caught.value)


def _refused(parallel):
    """What `prepare` refuses: `parallel` on the model, and a model with nothing to train."""
    plait.init()
    with pytest.raises(ValueError) as caught:
        plait.prepare(_model(True), F.cross_entropy, parallel)
    frozen = _model(True).requires_grad_(False)
    with pytest.raises(ValueError) as nothing:
        plait.prepare(frozen, F.cross_entropy, plait.ParallelConfig(zero=3))
    return str(caught.value), str(nothing.value)


def test_a_degree_that_needs_a_plan_and_a_model_with_nothing_to_train_are_refused():
    for message, nothing in run_world(_refused, 2, plait.ParallelConfig(tp=2)):
        assert message.startswith("parallel.tp=2 needs a model plan, and DigitsNet has none")
        assert nothing == "model: every parameter of DigitsNet has requires_grad=False; " \
            "nothing to train (unfreeze what should learn)"  # torch's error at backward before


def _accumulated_checkpointed_resumed(tmp):
    """ZeRO-3 with 2 micro-batches and every ConvBlock recomputed in the backward: 2 steps,
    a sharded checkpoint, then a new job on another layout (ZeRO-1) loads it (from the folder
    `save` wrote into: the newest complete checkpoint, not a later unfinished one) and trains 2
    more."""
    plait.init()
    first = plait.prepare(_model(False), F.cross_entropy,
                          plait.ParallelConfig(zero=3, microbatches=2),
                          wrap=plait.WrapPolicy(classes=(digits.ConvBlock,)),
                          checkpoint=plait.WrapPolicy(classes=(digits.ConvBlock,)))
    optimizer = torch.optim.AdamW(first.parameters(), lr=LR)
    batches = _batches()
    losses = [first.step(*first.local(x, y), optimizer, grad_clip=1.0) for x, y in batches[:2]]
    first.save(tmp, optimizer, step=2)
    torch.manual_seed(5)  # other weights: the checkpoint must replace them all
    second = plait.prepare(digits.DigitsNet(width=8).eval(), F.cross_entropy,
                           plait.ParallelConfig(zero=1))
    optimizer = torch.optim.AdamW(second.parameters(), lr=LR)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint there"):
        second.load(f"{tmp}/elsewhere", optimizer)
    if torch.distributed.get_rank() == 0:
        Path(tmp, "step-00000003").mkdir()  # a save that did not finish
    assert second.load(tmp, optimizer) == 2
    losses += [second.step(*second.local(x, y), optimizer, grad_clip=1.0) for x, y in batches[2:]]
    return losses, second.full_state_dict()


def test_accumulation_recomputation_and_a_resharded_checkpoint_equal_one_process(one_process,
                                                                                  tmp_path):
    for got in run_world(_accumulated_checkpointed_resumed, 2, str(tmp_path)):
        _assert_same(got, one_process, "zero3 accum2 checkpointed -> save -> zero1 load")


# Frozen parameters (`requires_grad=False`, a fine-tuning's): the first block whole (under
# ZeRO-3 a unit with nothing to train) and the second block's convolution (a unit that trains
# its norm alone). Every engine keeps them whole on every rank and steps nothing of them.
def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    for p in [*model.blocks[0].parameters(), *model.blocks[1].conv.parameters()]:
        p.requires_grad_(False)
    return model


def _frozen_resumed(parallel, wrap, tmp):
    """2 steps, a checkpoint, then a job of other weights (the frozen ones too) on ZeRO-1 loads
    it and trains 2 more."""
    plait.init()
    first = plait.prepare(_frozen(_model(False)), F.cross_entropy, parallel, wrap=wrap)
    optimizer = torch.optim.AdamW(first.parameters(), lr=LR)
    batches = _batches()
    losses = [first.step(*first.local(x, y), optimizer, grad_clip=1.0) for x, y in batches[:2]]
    first.save(tmp, optimizer, step=2)
    torch.manual_seed(5)
    second = plait.prepare(_frozen(digits.DigitsNet(width=8).eval()), F.cross_entropy,
                           plait.ParallelConfig(zero=1))
    optimizer = torch.optim.AdamW(second.parameters(), lr=LR)
    assert second.load(tmp, optimizer) == 2
    losses += [second.step(*second.local(x, y), optimizer, grad_clip=1.0) for x, y in batches[2:]]
    return losses, second.full_state_dict()


@pytest.mark.parametrize("name", ["ddp", "zero3 units by class"])
def test_frozen_parameters_stay_whole_and_are_checkpointed(name, tmp_path):
    """Equal to one process whose AdamW steps the trainable parameters alone (the frozen ones
    end where they began), through a checkpoint that holds the frozen ones: the second job's
    own draw of them is replaced. ZeRO-3 failed before, registering a gradient hook on them."""
    parallel, wrap = WHOLE[name]
    want = _one_process(lambda model: [torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR)],
        build=lambda: _frozen(_model(False)))
    for got in run_world(_frozen_resumed, 2, parallel, wrap, str(tmp_path)):
        _assert_same(got, want, f"frozen, {name} -> save -> zero1 load")
        start = _model(False).state_dict()
        assert all(torch.equal(got[1][n], start[n]) for n in ("blocks.0.conv.weight",
                                                               "blocks.1.conv.weight"))


def _unused():
    plait.init()
    model = _model(False)
    model.spare = torch.nn.Linear(2, 2)  # in no forward
    job = plait.prepare(model, F.cross_entropy)
    optimizer = torch.optim.AdamW(job.parameters(), lr=LR)
    x, y = _batches()[0]
    with pytest.raises(RuntimeError) as e:
        job.step(*job.local(x, y), optimizer)
    return str(e.value)


def test_a_parameter_without_a_gradient_is_named():
    for said in run_world(_unused, 2):
        assert said.startswith("parameters got no gradient this step: spare.weight, spare.bias")
        assert "parallel.unused_parameters = true" in said  # the option, named in the error


def _with_spare() -> torch.nn.Module:
    model = _model(False)
    model.spare = torch.nn.Linear(2, 2)  # in no forward
    return model


def _unused_zeroed(zero: int):
    plait.init()
    wrap = plait.WrapPolicy(classes=(digits.ConvBlock,)) if zero == 3 else None
    job = plait.prepare(_with_spare(), F.cross_entropy,
                        plait.ParallelConfig(zero=zero, unused_parameters=True), wrap=wrap)
    optimizer = torch.optim.AdamW(job.parameters(), lr=LR)
    losses = [job.step(*job.local(x, y), optimizer, grad_clip=1.0) for x, y in _batches()]
    return losses, job.full_state_dict()


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_unused_parameters_get_a_zero_gradient_under_every_engine(zero):
    """`parallel.unused_parameters`: a module in no forward takes a zero gradient (DDP's
    find_unused_parameters; FSDP's flat parameters reduce zeros), reduced with the others in
    bucket or unit order; the run equals one process whose unused gradients are set to zero
    (AdamW then only decays them), to the tolerance of `_assert_same`."""
    def zero_spare(model):
        for p in model.spare.parameters():
            p.grad = torch.zeros_like(p)

    want = _one_process(build=_with_spare, after_backward=zero_spare)
    assert not torch.equal(want[1]["spare.weight"], _with_spare().spare.weight)  # it decayed
    for got in run_world(_unused_zeroed, 2, zero):
        _assert_same(got, want, f"zero {zero}, unused_parameters")


def _fp16_plait():
    plait.init()
    job = plait.prepare(_model(False), F.cross_entropy, plait.ParallelConfig(), precision="fp16",
                        loss_scaler=plait.LossScaler(scale=2.0**10, growth_interval=1))
    optimizer = torch.optim.AdamW(job.parameters(), lr=LR)
    losses, scales = [], []
    for x, y in _batches():
        losses.append(job.step(*job.local(x, y), optimizer, grad_clip=1.0))
        scales.append(job.loss_scaler.scale)
    return losses, job.full_state_dict(), scales


def _fp16_one_process():
    model = _model(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    losses, scales = [], []
    for x, y in _batches():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, scales


def test_fp16_follows_torchs_grad_scaler():
    """fp16 from Python: DDP over 2 ranks with `plait.LossScaler` against one process with
    autocast and `torch.amp.GradScaler` (scale 2^10, doubling after every clean step): the same
    scales exactly, losses and parameters as fp16 summation order allows (measured 1e-6
    relative on the losses; test_fp16's tolerances)."""
    want = _fp16_one_process()
    assert want[2] == [2.0**11, 2.0**12, 2.0**13, 2.0**14]
    for losses, params, scales in run_world(_fp16_plait, 2):
        assert scales == want[2]
        assert losses == pytest.approx(want[0], rel=1e-3)
        for name, p in want[1].items():
            assert (params[name] - p).abs().mean() <= 3e-4, name


def _mlp() -> torch.nn.Module:
    """The digits as 64 pixels, through two linears (no BatchNorm: its fp32 running statistics
    meet bf16 weights in eval mode, which torch's batch_norm refuses)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 10))


def _bf16_params(parallel: plait.ParallelConfig):
    plait.init()
    job = plait.prepare(_mlp(), F.cross_entropy, parallel, precision="bf16", param_dtype="bf16")
    optimizer = torch.optim.AdamW(job.parameters(), lr=LR)
    losses = [job.step(*job.local(x, y), optimizer, grad_clip=1.0) for x, y in _batches()]
    dtypes = {p.dtype for p in job.model.parameters()} | {p.dtype for p in job.parameters()}
    return losses, job.full_state_dict(), dtypes


def test_bf16_parameters_under_ddp_train_as_zero1s_masters():
    """`param_dtype="bf16"` under DDP: the module's parameters are bf16, the optimizer steps
    fp32 masters, and 2 ranks train as ZeRO-1's bf16 parameters with fp32 masters do (the
    same math, reduced in fp32 instead of sliced): losses within 1e-3 relative and a mean
    parameter difference of 3e-4, the bf16 rows' tolerances (test_compositions)."""
    ddp = run_world(_bf16_params, 2, plait.ParallelConfig())
    zero = run_world(_bf16_params, 2, plait.ParallelConfig(zero=1))
    for (losses, params, dtypes), (want_losses, want_params, _) in zip(ddp, zero, strict=True):
        assert dtypes == {torch.bfloat16, torch.float32}
        assert losses == pytest.approx(want_losses, rel=1e-3)
        for name, p in want_params.items():
            assert (params[name].float() - p.float()).abs().mean() <= 3e-4, name


# Optimizers that need whole tensors (`prepare(whole=...)`, `Prepared.optimizer`): the
# convolutions' and the head's weights whole on their owners, the rest (biases, BatchNorm) sliced.
def _whole(name: str, p: torch.Tensor) -> bool:
    return p.dim() >= 2


def _whole_plait(parallel, wrap, factory, whole=_whole, tmp=None):
    """Losses and parameters; with `tmp`, also the refusal to load the checkpoint saved there
    at the end into Adafactor (the error)."""
    plait.init()
    job = plait.prepare(_model(False), F.cross_entropy, parallel, wrap=wrap, whole=whole)
    optimizer = job.optimizer(factory, lambda ps: torch.optim.AdamW(ps, lr=LR))
    losses = [job.step(*job.local(x, y), optimizer, grad_clip=1.0) for x, y in _batches()]
    if tmp is None:
        return losses, job.full_state_dict()
    job.save(tmp, optimizer, step=STEPS)
    with pytest.raises(ValueError) as refused:
        job.load(tmp, job.optimizer(_adafactor, lambda ps: torch.optim.AdamW(ps, lr=LR)))
    return losses, job.full_state_dict(), str(refused.value).replace(tmp, "TMP")


def _whole_one_process(factory, whole=_whole):
    def optimizers_of(model):
        named = list(model.named_parameters())
        return [factory([p for n, p in named if whole(n, p)]),
                torch.optim.AdamW([p for n, p in named if not whole(n, p)], lr=LR)]

    return _one_process(optimizers_of)


def _adafactor(params):
    """Factored second moments: a row and a column statistic of each whole matrix."""
    return torch.optim.Adafactor(params, lr=LR)


WHOLE = {
    "ddp": (plait.ParallelConfig(), None),
    "zero1": (plait.ParallelConfig(zero=1), None),
    "zero3 units by class": (plait.ParallelConfig(zero=3),
                             plait.WrapPolicy(classes=(digits.ConvBlock,))),
}


@pytest.mark.parametrize("name", list(WHOLE))
def test_an_optimizer_of_whole_matrices_equals_one_process(name):
    """torch's Adafactor (fp32; tolerances as AdamW's) gets each weight whole on its owner."""
    parallel, wrap = WHOLE[name]
    want = _whole_one_process(_adafactor)
    for got in run_world(_whole_plait, 2, parallel, wrap, _adafactor):
        _assert_same(got, want, f"Adafactor, {name}")


def _whole_resumed(tmp):
    """Adafactor over the whole matrices, AdamW over the rest, under ZeRO-3 (each matrix's
    state on its one owner, AdamW's in slices): 2 steps, a checkpoint, then a job under DDP
    loads it and trains 2 more. Loading it into an optimizer of another kind (SGD with
    momentum, over the same matrices) is refused on every rank before anything is read (a rank
    owning no matrix too: the Muon test below)."""
    plait.init()
    first = plait.prepare(_model(False), F.cross_entropy, plait.ParallelConfig(zero=3),
                          wrap=plait.WrapPolicy(classes=(digits.ConvBlock,)), whole=_whole)
    optimizer = first.optimizer(_adafactor, lambda ps: torch.optim.AdamW(ps, lr=LR))
    batches = _batches()
    losses = [first.step(*first.local(x, y), optimizer, grad_clip=1.0) for x, y in batches[:2]]
    first.save(tmp, optimizer, step=2)
    second, losses_after = _whole_loaded(tmp, plait.ParallelConfig())
    return losses + losses_after(), second.full_state_dict(), _refusals(tmp, second)


def _refusals(tmp, job) -> list[str]:
    """What loading `tmp` (Adafactor over the whole matrices) refuses: into SGD with momentum
    over them; into a job that steps them elementwise; and an elementwise optimizer's checkpoint
    into `job`'s Adafactor. Each before anything is read, on every rank."""
    out = []
    plain = plait.prepare(_model(False), F.cross_entropy)
    plain.save(f"{tmp}/plain", adamw := torch.optim.AdamW(plain.parameters(), lr=LR), step=1)
    for target, root, optimizer in (
            (job, tmp, job.optimizer(lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
                                     lambda ps: torch.optim.AdamW(ps, lr=LR))),
            (plain, tmp, adamw),
            (job, f"{tmp}/plain", job.optimizer(_adafactor, lambda ps: torch.optim.AdamW(ps)))):
        with pytest.raises(ValueError) as refused:
            target.load(root, optimizer)
        out.append(str(refused.value).replace(str(tmp), "TMP"))
    with pytest.raises(ValueError) as refused:  # AdamW over what a job of whole= gives it
        job.load(tmp, torch.optim.AdamW(job.parameters(), lr=LR))
    return out + [str(refused.value)]


def _whole_loaded(tmp, parallel):
    """A job of other weights that loads `tmp` into Adafactor and AdamW; (the job, a function
    that trains it the last 2 steps)."""
    torch.manual_seed(5)  # other weights: the checkpoint must replace them all
    job = plait.prepare(digits.DigitsNet(width=8).eval(), F.cross_entropy, parallel,
                        whole=_whole)

    def train():
        optimizer = job.optimizer(_adafactor, lambda ps: torch.optim.AdamW(ps, lr=LR))
        assert job.load(tmp, optimizer) == 2
        return [job.step(*job.local(x, y), optimizer, grad_clip=1.0)
                for x, y in _batches()[2:]]

    return job, train


def _whole_loaded_alone(tmp):
    plait.init()
    job, train = _whole_loaded(tmp, plait.ParallelConfig(zero=1))
    return train(), job.full_state_dict()


def test_an_optimizer_of_whole_matrices_reshards_through_a_checkpoint(tmp_path):
    want = _whole_one_process(_adafactor)
    for got in run_world(_whole_resumed, 2, str(tmp_path)):
        _assert_same(got, want, "Adafactor, zero3 -> save -> ddp load")
        assert got[2] == [
            "TMP/step-00000002 holds Adafactor's state of the whole matrices: load it into the "
            "optimizer it was saved with",
            "TMP/step-00000002 holds the state of an optimizer of whole matrices "
            "(Prepared.optimizer): load it into one",
            "TMP/plain/step-00000001 holds an elementwise optimizer's state of "
            "blocks.0.conv.weight, which this optimizer steps whole: load it into the "
            "optimizer it was saved with",
            "blocks.0.conv.weight: what this rank holds of it is in no group of the optimizer: "
            "build the optimizer over the job's parameters() (with prepare(whole=...): "
            "job.optimizer(...))"]
    # One process owns every matrix: it reads the state both owners wrote.
    (losses, params), = run_world(_whole_loaded_alone, 1, str(tmp_path))
    _assert_same((want[0][:2] + losses, params), want, "Adafactor, zero3 -> save -> one rank")


def _matrix(name: str, p: torch.Tensor) -> bool:
    return p.dim() == 2


def _torch_muon(params):
    return torch.optim.Muon(params, lr=LR)


def test_torch_muon_through_the_python_api_under_zero3(tmp_path):
    """A user's `torch.optim.Muon` on the whole head matrix under ZeRO-3 (its one matrix: the
    other rank owns none), within Muon's tolerances (test_compositions.py's MUON_ROWS say why).
    Its checkpoint loaded into Adafactor is refused on both ranks, the one owning nothing too
    (which would otherwise wait for the other in the read)."""
    want_losses, want = _whole_one_process(_torch_muon, _matrix)
    for losses, got, refused in run_world(_whole_plait, 2, plait.ParallelConfig(zero=3), None,
                                          _torch_muon, _matrix, str(tmp_path)):
        assert losses == pytest.approx(want_losses, rel=1e-4)
        for name, p in want.items():
            assert (got[name] - p).abs().mean() <= 1e-4, name
        assert refused == ("TMP/step-00000004 holds Muon's state of the whole matrices: load "
                           "it into the optimizer it was saved with")


# Parameter groups by name (`prepare(groups=...)`, `Prepared.param_groups`): weight decay on the
# convolutions' and the head's weights only, as one process with the same groups.
def _group(name: str, p: torch.Tensor) -> str:
    return "decay" if name.endswith("weight") and p.dim() > 1 else "no_decay"


def _adamw_by_group(groups: dict) -> torch.optim.AdamW:
    return torch.optim.AdamW([{"params": ps, "weight_decay": 0.5 if g == "decay" else 0.0}
                              for g, ps in groups.items()], lr=LR)


def _grouped_plait(parallel, wrap):
    plait.init()
    job = plait.prepare(_model(False), F.cross_entropy, parallel, wrap=wrap, groups=_group)
    groups = job.param_groups()
    optimizer = _adamw_by_group(groups)
    losses = [job.step(*job.local(x, y), optimizer, grad_clip=1.0) for x, y in _batches()]
    return losses, job.full_state_dict(), sorted(groups)


def _grouped_one_process():
    def optimizers_of(model):
        groups = {}
        for n, p in model.named_parameters():
            groups.setdefault(_group(n, p), []).append(p)
        return [_adamw_by_group(groups)]

    return _one_process(optimizers_of)


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero3 units by class"])
def test_parameter_groups_by_name_equal_one_process(name):
    """A weight decay of 0.5 on one group moves its parameters by ~lr * 0.5 * |w| a step more
    than the other's: a slice stepped in the wrong group would show."""
    parallel, wrap = WHOLE[name]
    want = _grouped_one_process()
    for losses, params, names in run_world(_grouped_plait, 2, parallel, wrap):
        assert names == ["decay", "no_decay"]
        _assert_same((losses, params), want, f"groups, {name}")
