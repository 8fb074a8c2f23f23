"""`plait bench step --nproc N train.optimizer=muon [layout]`: Muon's exchange (each matrix
orthogonalized once, by its owner: `optim/muon.py`) against the simplest correct alternative,
in which every rank all-gathers every matrix whole and orthogonalizes all of them (what a user
who hands ZeRO's or tp's pieces to `torch.optim.Muon` would have to write). Both are plait's
trainer step on the same processes, taking turns; also each one's optimizer step alone."""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.elastic.multiprocessing.errors import record

from plait.bench.load import OtherLoad
from plait.bench.step import start_worker, summarize, with_free_dp
from plait.comm import all_gather
from plait.config.schema import Config, ConfigError
from plait.host_memory import malloc_threshold
from plait.launch import launch
from plait.optim.muon import SHIPPED, MatrixExchange, _zeropower_via_newtonschulz
from plait.train.checks import validate
from plait.train.trainer import Trainer


class EverywhereExchange(MatrixExchange):
    """Every rank gathers every matrix whole (an all-gather of the slices over each data group,
    then of the shards over tp) and orthogonalizes all of them, keeping its own pieces."""

    def orthogonalize(self, updates, coefficients, steps, eps):
        mine = {}
        for key, update in updates.items():
            flat = update.reshape(-1)
            for piece in self.pieces.get(key, []):
                mine[piece.matrix.name] = (piece.start, flat[piece.lo : piece.lo + piece.count]
                                           .to(SHIPPED))
        device = next(iter(updates.values())).device if updates else torch.device("cpu")
        shards = {}
        for data in self.routes.groups:
            mats = self.routes.of(data)
            if not data.sharded:
                shards.update({m.name: mine[m.name][1] for m in mats})
                continue
            size = max(sum(m.part(j)[1] for m in mats) for j in range(data.size))
            payload = torch.zeros(size, dtype=SHIPPED, device=device)
            at = 0
            for m in mats:
                if m.name in mine:
                    values = mine[m.name][1]
                    payload[at : at + len(values)] = values
                    at += len(values)
            gathered = torch.empty(size * data.size, dtype=SHIPPED, device=device)
            all_gather(gathered, payload, data.group)
            for m in mats:
                shards[m.name] = torch.empty(m.local_numel, dtype=SHIPPED, device=device)
            for j in range(data.size):
                at = j * size
                for m in mats:
                    start, count = m.part(j)
                    shards[m.name][start : start + count] = gathered[at : at + count]
                    at += count
        whole = {m.name: shards[m.name].view(m.local_shape) for m in self.matrices}
        split = [m for m in self.matrices if m.tp_dim is not None]
        if split:
            payload = torch.cat([shards[m.name] for m in split])
            gathered = torch.empty(len(payload) * self.tp.size, dtype=SHIPPED, device=device)
            all_gather(gathered, payload, self.tp.group)
            parts = gathered.view(self.tp.size, -1)
            at = 0
            for m in split:
                whole[m.name] = torch.cat([parts[t, at : at + m.local_numel].view(m.local_shape)
                                           for t in range(self.tp.size)], dim=m.tp_dim)
                at += m.local_numel
        out = {}
        for m in self.matrices:
            done = _zeropower_via_newtonschulz(whole[m.name], coefficients, steps, eps)
            if m.tp_dim is not None:
                n = m.local_shape[m.tp_dim]
                done = done.narrow(m.tp_dim, self.tp.rank * n, n)
            if m.name in mine:
                start, values = mine[m.name]
                out[m.name] = done.reshape(-1)[start : start + len(values)]
        return out


@record
def bench_muon(cfg: Config, steps: int) -> dict | None:
    dims, mesh = start_worker(cfg)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_clip=0.0))
    trainers = {name: Trainer(cfg, dims, mesh, torch.device("cpu"))
                for name in ("owners", "everywhere")}
    alt = trainers["everywhere"]
    alt.optimizer.exchange = EverywhereExchange(alt.parallelized.engine, alt.parallelized.record,
                                                alt.parallelized.axes["tp"])
    seconds = {f"{name}_optimizer": [] for name in trainers}
    for name, trainer in trainers.items():
        step = trainer.optimizer.step

        def timed(closure=None, step=step, name=name):
            start = time.perf_counter()
            step()
            seconds[f"{name}_optimizer"].append(time.perf_counter() - start)

        trainer.optimizer.step = timed
    times = {name: [] for name in trainers}
    group = dist.group.WORLD
    for i in range(steps + 2):
        order = list(trainers) if i % 2 == 0 else list(trainers)[::-1]
        for name in order:
            dist.barrier(group)
            start = time.perf_counter()
            trainers[name].train_step(0)
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    for name in trainers:
        times[f"{name}_optimizer"] = seconds[f"{name}_optimizer"][2:]
    for name, ts in times.items():
        t = torch.tensor(ts)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[name] = t.tolist()
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {**times, "malloc_threshold": malloc_threshold()} if rank == 0 else None


def run_muon_step(nproc: int, cfg: Config, steps: int, repeats: int = 2) -> list[dict]:
    if cfg.parallel.pp > 1:
        raise ConfigError("parallel.pp", "bench step with Muon compares its exchange over dp "
                          "and tp; set pp = 1")
    cfg = with_free_dp(cfg)
    dims = validate(cfg, nproc)
    pooled = {}
    with OtherLoad() as load:
        for _ in range(repeats):
            got = launch(nproc, bench_muon, cfg, steps, threads=cfg.train.threads)[0]
            got.pop("malloc_threshold")
            for name, ts in got.items():
                pooled.setdefault(name, []).extend(ts)
    t = summarize(pooled)
    args, par = cfg.model.args(), cfg.parallel
    engine = f"ZeRO-{par.zero}" if par.zero else "DDP"
    table = Table(title=(
        f"plait bench step, Muon: dp {dims.dp} x tp {dims.tp}, {engine}; model dim {args.dim} x "
        f"{args.n_layers} layers, batch {cfg.train.global_batch} x {cfg.data.seq_len} tokens; "
        f"median of {steps} x {repeats} steps"))
    for col in ("variant", "step (ms)", "spread", "optimizer step (ms)", "spread",
                "owners / this: step", "optimizer step"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    rows = []
    for variant, name in (("each matrix once, by its owner (plait)", "owners"),
                          ("every rank gathers and orthogonalizes every matrix", "everywhere")):
        opt = f"{name}_optimizer"
        table.add_row(variant, f"{t[name] * 1e3:,.1f}", f"{t[name + '_spread']:.1%}",
                      f"{t[opt] * 1e3:,.1f}", f"{t[opt + '_spread']:.1%}",
                      f"{t['owners'] / t[name]:.3f}",
                      f"{t['owners_optimizer'] / t[opt]:.3f}")
        rows.append({"variant": name, "seconds": t[name], "optimizer_seconds": t[opt],
                     "other_load": load.share})
    Console(width=170).print(table)
    Console().print(f"other load: {load.share:.0%} of the cores used by other processes")
    return rows
