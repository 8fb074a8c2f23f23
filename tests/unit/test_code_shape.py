"""The shape docs/design.md promises of the code: short functions, and class names that say one
thing (neither two of plait's classes nor one of plait's and one of torch's share a name)."""

import ast
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed
import torch.distributed.checkpoint
import torch.distributed.fsdp
import torch.optim

PLAIT = Path(__file__).resolve().parents[2] / "plait"


def _defs(kind):
    for path in sorted(PLAIT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kind):
                yield path.relative_to(PLAIT.parent), node


def test_no_function_is_longer_than_60_lines():
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, node in _defs((ast.FunctionDef, ast.AsyncFunctionDef))
            if node.end_lineno - node.lineno + 1 > 60]
    assert long == []


def test_class_names_are_plaits_own_and_say_one_thing():
    seen: dict[str, str] = {}
    twice = []
    for path, node in _defs(ast.ClassDef):
        if node.name in seen:
            twice.append(f"{node.name}: {seen[node.name]} and {path}")
        seen[node.name] = str(path)
    assert twice == []
    # The namespaces a user of plait imports from (not torch's own top level, which holds the
    # TorchScript graph's classes: Block, Node, Value).
    torchs = {name for module in (torch.nn, torch.optim, torch.distributed,
                                  torch.distributed.checkpoint, torch.distributed.fsdp)
              for name in dir(module) if isinstance(getattr(module, name, None), type)}
    assert sorted(set(seen) & torchs) == []


def test_imports_keep_the_layers_of_the_design_and_make_no_cycle():
    """pyproject.toml's import-linter contracts: docs/design.md's layers, each importing only
    those below it, no import cycle, and the configuration beside them importing only the mesh and
    the model; imports inside functions count too (grimp reads them)."""
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint), "--no-cache"], cwd=PLAIT.parent, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "3 kept, 0 broken" in proc.stdout


# torch.distributed's calls that move data or wait for other ranks.
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "all_to_all", "all_to_all_single", "send",
               "recv", "isend", "irecv", "barrier", "monitored_barrier", "reduce", "gather",
               "scatter", "all_gather_object", "broadcast_object_list", "gather_object",
               "scatter_object_list", "batch_isend_irecv"}


def test_collectives_go_through_comm_on_a_group_they_are_given():
    """docs/design.md: every collective is called in comm (where the ledger counts it) with an
    explicit group; the group over every rank comes from one place, `mesh.world_axis`. The
    benches, which time torch's own collectives against plait's, are outside the rule."""
    direct, world = [], []
    for path, node in _defs(ast.Attribute):
        where = f"{path}:{node.lineno}"
        inside = path.parts[1] in ("comm", "bench")
        if node.attr in COLLECTIVES and ast.unparse(node.value) in ("dist", "torch.distributed") \
                and not inside:
            direct.append(f"{where} {ast.unparse(node)}")
        if node.attr == "WORLD" and str(path) != "plait/mesh.py" and not inside:
            world.append(f"{where} {ast.unparse(node)}")
    assert direct == []
    assert world == []
