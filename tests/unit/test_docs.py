"""The documents stay true to the code: every configuration key and command is documented in
README.md or docs/, every relative link leads to a file, and the README stays an entry page."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from plait.cli import _parser
from plait.config.schema import ASYNC, Config
from plait.model.args import ModelArgs

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT = "".join(p.read_text() for p in PAGES)


def _keys() -> list[str]:
    cfg, keys = Config(), []
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            if f.name != "overrides":  # model.overrides holds the ModelArgs keys below
                keys.append(f"{section.name}.{ASYNC if f.name == 'async_' else f.name}")
    return keys + [f"model.{f.name}" for f in dataclasses.fields(ModelArgs)]


def _documented(key: str) -> bool:
    """`section.key` anywhere, or `key` / `.key` in a table row of the section's keys (rows
    group related keys: `train.lr`, `.warmup_steps`, `.min_lr_ratio`)."""
    section, name = key.split(".")
    rows = [line for line in TEXT.splitlines() if line.startswith(f"| `{section}.")]
    return f"`{key}`" in TEXT or key in TEXT or \
        any(f"`.{name}`" in row or f"`{name}`" in row for row in rows)


@pytest.mark.parametrize("key", _keys())
def test_every_configuration_key_is_documented(key):
    assert _documented(key), f"{key} is in no page of README.md or docs/"


def test_every_command_is_documented():
    commands = _parser()._subparsers._group_actions[0].choices
    for name in commands:
        assert f"plait {name}" in TEXT, name


def test_every_relative_link_leads_to_a_file():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")):
                assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_the_readme_is_an_entry_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 220
    assert "used to" not in (ROOT / "README.md").read_text()  # history lives in the docs


def test_the_readmes_python_runs_as_written(tmp_path):
    """The README's Python block, copied out as it is, run as a script (a world of one process,
    as `plait.init` makes without a launcher): it trains, prints its loss and saves."""
    import os
    import subprocess
    import sys

    block = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    (tmp_path / "snippet.py").write_text(block)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "examples"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.fullmatch(r"loss \d+\.\d{4}\n", proc.stdout), proc.stdout
    assert (tmp_path / "ckpt").is_dir()
