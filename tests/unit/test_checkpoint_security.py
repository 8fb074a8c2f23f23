"""A checkpoint runs nothing it holds: DCP's `.metadata` is a pickle, and a crafted one (here,
a real checkpoint's metadata with a payload that touches a marker file when unpickled) is refused
on every path that reads a checkpoint — the launcher's resume check, `plait convert --to hf`,
`load_full`, and the reader the workers' `load` hands DCP — with no marker written. Plain
`pickle.load`, DCP's own reader, would write it (asserted first, so the payload is live)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from plait import cli
from plait.checkpoint import finish, meta
from plait.checkpoint.metadata import CheckpointReader, UnsafeCheckpoint, read_metadata
from plait.checkpoint.rank_state import load_full, one_process
from plait.config.schema import load_config

MODEL = ["model.preset=tiny", "model.n_layers=1", "model.vocab_size=256", "data.seq_len=32"]


class _Touch:
    """Unpickled, it creates `path` (what a hostile file could do with any command)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _checkpoint(path):
    cfg = load_config(None, MODEL)
    sd = {"model.w": torch.randn(3, 4), "train.step": torch.tensor(0)}
    with one_process():
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    finish(path, meta(cfg, 0, 1, contents=("model",)))
    return path


def _plant(path, marker):
    """Replace the checkpoint's metadata by itself carrying the payload (it still loads)."""
    metadata = read_metadata(path)
    metadata.storage_meta.checkpoint_id = _Touch(marker)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.fixture
def crafted(tmp_path):
    path, marker = _checkpoint(tmp_path / "step-00000000"), tmp_path / "marker"
    _plant(path, marker)
    with open(path / ".metadata", "rb") as f:  # the payload is live: DCP's own way runs it
        pickle.load(f)
    assert marker.exists()
    marker.unlink()
    return path, marker


def test_a_real_checkpoint_reads(tmp_path):
    path = _checkpoint(tmp_path / "ck")
    assert set(load_full(path)) == {"w"}
    assert tuple(read_metadata(path).state_dict_metadata["model.w"].size) == (3, 4)


def test_resume_refuses_a_checkpoint_of_another_model_in_one_line(tmp_path, capsys):
    """The held model's shape (plait.json's model section, read without torch) against this
    run's: the first size that differs, named."""
    path = _checkpoint(tmp_path / "step-00000000")
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--dry-run", f"checkpoint.resume={path}", *MODEL, "model.n_layers=2"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"plait: error: checkpoint.resume: {path} holds a model with layers=1, this "
                   "run's has layers=2; resume with the same model settings, or set "
                   "checkpoint.resume='never'"]


def test_resume_refuses_crafted_metadata_before_launch(crafted, capsys):
    path, marker = crafted
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--dry-run", f"checkpoint.resume={path}", *MODEL])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1
    assert "checkpoint.resume" in err[0] and "posix.system" in err[0] and str(path) in err[0]
    assert not marker.exists()


def test_convert_refuses_crafted_metadata(crafted, tmp_path, capsys):
    path, marker = crafted
    with pytest.raises(SystemExit) as exit_:
        cli.main(["convert", "--to", "hf", str(tmp_path / "hf"), str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("plait: error: CKPT")
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_the_workers_reader_refuses_crafted_metadata(crafted):
    path, marker = crafted
    with pytest.raises(UnsafeCheckpoint, match="refusing"):
        load_full(path)
    sd = {"model.w": torch.empty(3, 4)}
    with pytest.raises(CheckpointException) as raised, one_process():  # `checkpoint.load`'s way
        dcp.load(sd, storage_reader=CheckpointReader(str(path)), no_dist=True)
    # DCP wraps each rank's error; torch 2.11's swallows the reader's (it logs it) and asserts
    # "metadata is None" (plait's `rank_state.load` reads the metadata itself first).
    old = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 12)
    said = str(raised.value)
    assert "names posix.system" in said or old and "metadata is None" in said, said
    assert not marker.exists()


def test_pickled_entries_and_garbage_are_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = _checkpoint(tmp_path / "ck")
    metadata = read_metadata(path)
    metadata.state_dict_metadata["train.step"] = BytesStorageMetadata()
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpoint, match="BytesStorageMetadata"):
        read_metadata(path)
    (path / ".metadata").write_bytes(b"\x80\x05garbage")
    with pytest.raises(UnsafeCheckpoint, match="is not a checkpoint's metadata"):
        read_metadata(path)
    (path / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(UnsafeCheckpoint, match="not DCP's Metadata"):
        read_metadata(path)


def _rewritten(path, change) -> None:
    """The checkpoint's metadata, built from allowed classes only, changed by `change`."""
    metadata = read_metadata(path)
    change(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def _storage(path: str):
    def change(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = path
    return change


def _size(metadata):
    metadata.state_dict_metadata["model.w"].size = "3, 4"


def _chunks(metadata):
    metadata.state_dict_metadata["model.w"].chunks[0].offsets = torch.Size([-1, 0])


@pytest.mark.parametrize("change,said", [
    (_storage("/etc/passwd"), "is not a file name inside the checkpoint"),
    (_storage("../outside.distcp"), "is not a file name inside the checkpoint"),
    (_storage("missing.distcp"), "is not a regular file there"),
    (_size, "entry 'model.w''s size is not a size"),
    (_chunks, "chunk offsets is not a size"),
], ids=["absolute", "dot-dot", "missing", "size", "chunk"])
def test_metadata_of_allowed_classes_is_checked_as_a_schema_before_launch(tmp_path, capsys,
                                                                           change, said):
    """Metadata made only of allowed classes, but wrong: storage paths that would read tensor
    files outside the checkpoint (DCP joins the folder and the path), a size that is a string,
    a negative offset. Refused in one line by the launcher's check, before any worker."""
    path = _checkpoint(tmp_path / "ck")
    _rewritten(path, change)
    with pytest.raises(UnsafeCheckpoint, match=said):
        read_metadata(path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--dry-run", f"checkpoint.resume={path}", *MODEL])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and said in err[0]


def test_a_link_out_of_the_checkpoint_and_a_fifo_are_refused(tmp_path):
    path = _checkpoint(tmp_path / "ck")
    name = next(iter(read_metadata(path).storage_data.values())).relative_path
    outside = tmp_path / "elsewhere.distcp"
    (path / name).rename(outside)
    (path / name).symlink_to(outside)
    with pytest.raises(UnsafeCheckpoint, match="leads outside the checkpoint"):
        read_metadata(path)
    (path / ".metadata").unlink()
    os.mkfifo(path / ".metadata")  # opened, it would block the reader
    with pytest.raises(UnsafeCheckpoint, match="is not a regular file"):
        read_metadata(path)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"config": {"model": 3}}'],
                         ids=["garbled", "a-list", "no-model"])
def test_plaits_own_metadata_that_is_not_its_own_is_refused_in_one_line(tmp_path, capsys, text):
    """plait.json that is not JSON, or not the object plait writes: resume and convert refuse it
    in one line naming the file (it was a JSONDecodeError or KeyError traceback)."""
    path = _checkpoint(tmp_path / "ck")
    (path / "plait.json").write_text(text)
    for argv in (["train", "--dry-run", f"checkpoint.resume={path}", *MODEL],
                 ["convert", "--to", "hf", str(tmp_path / "hf"), str(path)]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1, err
        assert "plait.json is not plait's metadata" in err[0]


def _pickled_file(path, marker):
    """The tensor file's bytes replaced by a pickle with the payload, padded to the file's size
    (DCP's workers would refuse it with weights_only, after launch)."""
    for name in {i.relative_path for i in read_metadata(path).storage_data.values()}:
        size = (path / name).stat().st_size
        (path / name).write_bytes(pickle.dumps(_Touch(marker)).ljust(size, b"\0"))


def _truncated_file(path, marker):
    for name in {i.relative_path for i in read_metadata(path).storage_data.values()}:
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[: len(data) // 2])


def _other_dtype(path, marker):
    """A well-formed tensor file of the right shape but another dtype than the metadata says:
    loaded, DCP would copy it into the run's tensor with a silent cast."""
    metadata = read_metadata(path)
    metadata.state_dict_metadata["model.w"].properties.dtype = torch.float64
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("change,said", [
    (_pickled_file, "is not a tensor torch.load(weights_only=True) reads"),
    (_truncated_file, "past the end of the file"),
    (_other_dtype, "not the torch.float64 tensor of 'model.w'"),
], ids=["pickle", "truncated", "dtype"])
def test_tensor_files_are_checked_before_launch(tmp_path, capsys, change, said):
    """`.metadata` may be fine and the tensor files not: each storage item is read as DCP's
    workers read it (`torch.load(weights_only=True)`, here on the meta device: no data), by the
    launcher's resume check and by convert, refused in one line; nothing the pickle names
    runs."""
    path, marker = _checkpoint(tmp_path / "ck"), tmp_path / "marker"
    change(path, marker)
    for argv in (["train", "--dry-run", f"checkpoint.resume={path}", *MODEL],
                 ["convert", "--to", "hf", str(tmp_path / "hf"), str(path)]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and said in err[0], err
    assert not marker.exists()


# -- any metadata, any storage path, any file kind: read, or refused in one line ------------------

_OPENED: list[str] = []  # files opened while `_WATCHING` (an audit hook cannot be removed)
_WATCHING = [False]


def _audit(event, args):
    if _WATCHING[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


def _bad_values():
    """A value of another type, sign or size than a field's."""
    from hypothesis import strategies as st

    return st.one_of(st.integers(-3, 2**40), st.none(), st.text(max_size=8),
                     st.floats(allow_nan=True), st.lists(st.integers(-2, 5), max_size=3),
                     st.sampled_from([torch.Size([-1, 4]), torch.Size([4, 3]), "float32"]))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    import sys

    sys.addaudithook(_audit)
    return _checkpoint(tmp_path_factory.mktemp("pristine") / "ck")


def test_any_metadata_is_read_or_refused_in_one_line_and_nothing_outside_is_read(pristine,
                                                                                  tmp_path):
    """A property (hypothesis): from a real checkpoint, its metadata rewritten with random
    well-typed and ill-typed fields (storage paths absolute, with `..`, empty, random text;
    offsets, lengths, sizes, chunk offsets and dtypes of any type and sign) and its tensor file
    replaced by another kind (a link out, a directory, a FIFO, missing, random bytes). The
    launcher's check (`check_checkpoint`) either passes it or raises plait's one-line
    `UnsafeCheckpoint`/`BadMeta` -- never another exception (a traceback) -- and opens no file
    outside the checkpoint (an audit hook records every open)."""
    import shutil

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from plait.checkpoint import BadMeta
    from plait.checkpoint.metadata import check_checkpoint

    outside = tmp_path / "outside.distcp"
    shutil.copy(pristine / "__0_0.distcp", outside)
    kinds = st.sampled_from(["as is", "link out", "directory", "fifo", "missing", "bytes"])

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(path=st.one_of(st.sampled_from(["__0_0.distcp", "/etc/passwd", "../outside.distcp",
                                           str(outside), "", "a/../../outside.distcp",
                                           "./__0_0.distcp"]), st.text(max_size=12)),
           spoiled=st.sampled_from([None, "offset", "length", "size", "dtype", "chunk"]),
           value=_bad_values(), kind=kinds, noise=st.binary(max_size=64))
    def case(path, spoiled, value, kind, noise):
        folder = tmp_path / "ck"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(pristine, folder)
        metadata = read_metadata(folder)
        entry = metadata.state_dict_metadata["model.w"]
        fields = {"size": (entry, "size"), "dtype": (entry.properties, "dtype"),
                  "chunk": (entry.chunks[0], "offsets")}
        for info in metadata.storage_data.values():
            info.relative_path = path
            fields.update(offset=(info, "offset"), length=(info, "length"))
            if spoiled in ("offset", "length"):
                setattr(info, spoiled, value)
        if spoiled in ("size", "dtype", "chunk"):
            setattr(*fields[spoiled], value)
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
        data = folder / "__0_0.distcp"
        if kind != "as is":
            data.unlink()
        if kind == "link out":
            data.symlink_to(outside)
        elif kind == "directory":
            data.mkdir()
        elif kind == "fifo":
            os.mkfifo(data)
        elif kind == "bytes":
            data.write_bytes(noise)
        _OPENED.clear()
        _WATCHING[0] = True
        try:
            check_checkpoint(folder)
        except (UnsafeCheckpoint, BadMeta) as e:
            assert "\n" not in str(e)
        finally:
            _WATCHING[0] = False
        inside = str(folder.resolve())
        assert all(os.path.realpath(p).startswith(inside) for p in _OPENED
                   if not p.endswith((".py", ".pyc"))), _OPENED

    case()
