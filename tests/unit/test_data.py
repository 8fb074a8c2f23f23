"""Prepared corpora (`plait data prepare`) and epochs: the ids are the tokenizer's own, every
window is visited once per epoch, batches do not depend on the number of ranks."""

import json

import numpy as np
import pytest
from corpora import word_level_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.config.schema import DataConfig
from plait.data.batches import SMALL, TokenData, permute
from plait.data.tokenize_corpus import prepare

TEXTS = ["Plait trains one model on many ranks.\n", "Zürich, 東京 and naïve façades — ünïcödé.\n",
         "def f(x):\n    return x * 2\n" * 20, "short", "a " * 500]


@given(n=st.integers(1, 5000), key=st.integers(0, 2**64 - 1))
@settings(max_examples=60, deadline=None)
def test_permute_is_a_permutation(n, key):
    whole = permute(np.arange(n), n, key)  # numpy's path beyond 64 indices
    assert np.array_equal(np.sort(whole), np.arange(n))
    assert np.array_equal(whole[-SMALL:], permute(np.arange(n)[-SMALL:], n, key))  # Python's


def test_permute_depends_on_the_key():
    a, b = permute(np.arange(1000), 1000, 1), permute(np.arange(1000), 1000, 2)
    assert (a != b).mean() > 0.9 and (a != np.arange(1000)).mean() > 0.9


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Text files and the three table formats, each document known."""
    import datasets

    root = tmp_path_factory.mktemp("sources")
    (root / "files").mkdir()
    for i, text in enumerate(TEXTS[:3]):
        (root / "files" / f"{i}.txt").write_text(text)
    rows = [{"text": t, "id": i} for i, t in enumerate(TEXTS)]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = datasets.Dataset.from_list(rows[::-1])
    table.to_parquet(str(root / "rows.parquet"))
    import pyarrow as pa

    with pa.ipc.new_stream(str(root / "rows.arrow"), table.data.schema) as writer:
        writer.write_table(table.data.table)
    paths = [root / "files", root / "rows.jsonl", root / "rows.parquet", root / "rows.arrow"]
    documents = TEXTS[:3] + TEXTS + TEXTS[::-1] + TEXTS[::-1]
    return [str(p) for p in paths], documents


def _ids(folder):
    manifest = json.loads((folder / "manifest.json").read_text())
    ids = np.concatenate([np.fromfile(folder / s["file"], dtype=manifest["dtype"])
                          for s in manifest["shards"]])
    return manifest, ids, np.load(folder / "documents.npy")


def test_prepared_ids_are_the_tokenizers_own(sources, tmp_path):
    """bpe:N trains a byte-level BPE on the sources; each document's ids equal `tokenizers`'
    encoding of it, then the end-of-text id; decoding gives the text back; 2 workers write the
    same bytes as 1; shards of 100 ids cut documents anywhere and nothing is lost."""
    from tokenizers import Tokenizer

    paths, documents = sources
    one = prepare(paths, str(tmp_path / "one"), "bpe:300", workers=1, shard_tokens=100,
                  progress=False)
    tok = Tokenizer.from_file(str(tmp_path / "one" / "tokenizer.json"))
    manifest, ids, starts = _ids(tmp_path / "one")
    assert manifest["documents"] == len(documents) == len(starts) - 1
    assert manifest["tokens"] == len(ids) == starts[-1] and len(manifest["shards"]) > 2
    assert manifest["dtype"] == "uint16" and manifest["eot"] == tok.token_to_id("<|endoftext|>")
    for i, text in enumerate(documents):
        doc = ids[starts[i] : starts[i + 1]].tolist()
        assert doc == tok.encode(text).ids + [manifest["eot"]]
        assert tok.decode(doc[:-1]) == text
    two = prepare(paths, str(tmp_path / "two"), str(tmp_path / "one" / "tokenizer.json"),
                  workers=2, shard_tokens=100, progress=False)
    assert [s["sha256"] for s in two["shards"]] == [s["sha256"] for s in one["shards"]]


def test_bytes_are_their_own_ids(sources, tmp_path):
    paths, documents = sources
    prepare(paths[:1], str(tmp_path / "b"), "bytes", progress=False)
    manifest, ids, starts = _ids(tmp_path / "b")
    assert manifest["vocab_size"] == 256 and manifest["eot"] is None
    assert bytes(ids.astype(np.uint8)) == "".join(documents[:3]).encode()
    assert not (tmp_path / "b" / "tokenizer.json").exists()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Twelve documents of bytes: 3,540 ids, 110 windows of 32 + 1 in the training split."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "text").mkdir()
    for i in range(12):
        (root / "text" / f"{i:02d}.txt").write_text(f"{i:x}" * 295)
    prepare([str(root / "text")], str(root / "out"), "bytes", progress=False)
    return str(root / "out")


def test_every_window_once_per_epoch(corpus):
    data = TokenData(DataConfig(source=corpus, seq_len=32, val_fraction=0.05), seed=3)
    w, batch = data.train_windows, 7  # 7 does not divide the windows: batches straddle epochs
    seen = np.concatenate([data.windows(step, batch) for step in range(3 * w // batch + 1)])
    epochs = [seen[e * w : (e + 1) * w] for e in range(3)]
    for order in epochs:
        assert np.array_equal(np.sort(order), np.arange(w))
    assert not np.array_equal(epochs[0], epochs[1])  # each epoch its own order
    assert data.epochs(3, batch) == pytest.approx(21 / w)
    # The rows are those windows' ids: window k starts at id 32 k of the training split.
    x, y = data.batch(5, batch)
    ids = np.fromfile(f"{corpus}/shard-00000.bin", dtype=np.uint16).astype(np.int64)
    for row, k in enumerate(data.windows(5, batch)):
        assert x[row].tolist() == ids[32 * k : 32 * k + 32].tolist()
        assert y[row].tolist() == ids[32 * k + 1 : 32 * k + 33].tolist()


def test_validation_is_whole_documents_after_the_training_split(corpus):
    data = TokenData(DataConfig(source=corpus, seq_len=32, val_fraction=0.1), seed=0)
    assert data.split in data.corpus.starts.tolist()  # a document boundary
    assert data.split == 295 * 11  # 10% of 3,540 ids: the last document (295 ids)
    assert data.train_windows == (data.split - 1) // 32  # no window reaches validation


@pytest.mark.parametrize("ranks,microbatches", [(4, 1), (2, 2)])
def test_batches_are_the_same_at_any_number_of_ranks(corpus, ranks, microbatches):
    data = TokenData(DataConfig(source=corpus, seq_len=32), seed=1)
    for step in (0, 13, 40):  # 40: the fourth epoch
        whole = data.batch(step, 8)[0].view(microbatches, ranks, -1, 32)
        parts = [data.batch(step, 8, r, ranks, microbatches)[0] for r in range(ranks)]
        for r, part in enumerate(parts):
            assert np.array_equal(part.view(microbatches, -1, 32), whole[:, r])


def test_ids_beyond_uint16_are_stored_in_uint32(tmp_path):
    """A word-level vocabulary of 70,000: ids above 65,535 survive into training batches."""
    tokenizer = word_level_tokenizer(tmp_path / "tokenizer.json", 70_000)
    text = tmp_path / "doc.txt"
    text.write_text(" ".join(f"w{i}" for i in range(69_000, 70_000)))
    done = prepare([str(text)], str(tmp_path / "out"), str(tokenizer), progress=False)
    assert done["dtype"] == "uint32" and done["vocab_size"] == 70_001
    data = TokenData(DataConfig(source=str(tmp_path / "out"), seq_len=16), seed=0)
    x, _ = data.batch(0, 4)
    assert x.min() >= 69_000 and x.max() > 65_535


def test_a_model_folders_tokenizer_and_its_vocabulary(tmp_path):
    """`--tokenizer DIR` reads DIR/tokenizer.json and ends documents with DIR's `eos_token`;
    with `model.hf = DIR`, a corpus beyond the model's vocabulary (256) is refused, naming it."""
    from hf_models import write_model

    from plait.cli.commands import check_inputs
    from plait.config.schema import ConfigError, load_config

    folder = write_model(tmp_path / "gpt2", "gpt2")
    word_level_tokenizer(folder / "tokenizer.json", 300)
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["model"]["vocab"]["<eos>"] = 301  # a second end-of-text candidate, the one named
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eos>"}}))
    (tmp_path / "doc.txt").write_text("w1 w2 w299")
    done = prepare([str(tmp_path / "doc.txt")], str(tmp_path / "out"), str(folder),
                   progress=False)
    assert done["eot"] == 301 and done["vocab_size"] == 302
    assert _ids(tmp_path / "out")[1].tolist() == [1, 2, 299, 301]
    cfg = load_config(None, [f"model.hf={folder}", f"data.source={tmp_path / 'out'}"])
    with pytest.raises(ConfigError, match="302 tokens, the model 256") as e:
        check_inputs(cfg)
    assert e.value.field.startswith("model.hf")


@pytest.fixture
def blocky(tmp_path, monkeypatch):
    """A corpus of 1,500 checksummed blocks of 128 ids (256 bytes: small, so that most blocks are
    outside a launch's sample of 32), 3 shards."""
    import plait.data.tokenize_corpus

    monkeypatch.setattr(plait.data.tokenize_corpus, "BLOCK_BYTES", 256)
    text = tmp_path / "text"
    text.mkdir()
    for i in range(8):
        (text / f"{i}.txt").write_text(f"document {i}: " + "plait " * 4000)
    prepare([str(text)], str(tmp_path / "c"), "bytes", progress=False, shard_tokens=80_000)
    return tmp_path / "c"


def _flip(folder, block: int, ids_per_block: int = 128) -> None:
    """One bit of the first id of checksummed block `block` of the first shard."""
    shard = folder / "shard-00000.bin"
    ids = np.fromfile(shard, dtype=np.uint16)
    ids[block * ids_per_block] ^= 1
    ids.tofile(shard)


def test_a_changed_block_outside_the_sample_stops_training_where_it_is_read(blocky):
    """A launch verifies 32 blocks spread over the corpus (time independent of its size); a
    block changed elsewhere passes it, and stops the run when a batch reads it, naming the shard
    and the block's bytes. `plait data verify` reads every block and exits 2."""
    from plait import cli
    from plait.config.schema import load_config
    from plait.data.batches import check_source
    from plait.data.corpus import CorpusError, _sampled, read_manifest, shard_blocks

    sampled = _sampled(shard_blocks(blocky, read_manifest(blocky)))
    assert len(sampled) == 32 and (0, 0) in sampled
    block = next(b for b in range(300, 600) if (0, b) not in sampled)
    _flip(blocky, block)
    cfg = load_config(None, [f"data.source={blocky}", "data.seq_len=64"])
    assert check_source(cfg.data, 256, 64) == ""  # the sample does not see it
    data = TokenData(cfg.data, seed=0, vocab_size=256)
    shard = blocky / "shard-00000.bin"
    with pytest.raises(CorpusError, match=rf"data.source: {shard}: block {block} \(bytes "
                       rf"{block * 256:,} to {(block + 1) * 256:,}\) fails its checksum"):
        for step in range(10_000):
            data.batch(step, 64)
    with pytest.raises(SystemExit) as e:
        cli.main(["data", "verify", str(blocky)])
    assert e.value.code == 2


def test_a_changed_block_in_the_sample_is_refused_before_launch(blocky):
    from plait.config.schema import ConfigError, load_config
    from plait.data.batches import check_source

    _flip(blocky, 0)
    cfg = load_config(None, [f"data.source={blocky}", "data.seq_len=64"])
    with pytest.raises(ConfigError, match=r"shard-00000.bin: block 0 \(bytes 0 to 256\) fails"):
        check_source(cfg.data, 256, 64)


def test_a_corpus_without_block_checksums_still_checks_each_ids_range(blocky):
    """A corpus an older plait prepared (no checksums.npy): said once at launch; an id beyond the
    vocabulary still stops the run where a batch reads it, naming the shard and the id."""
    from plait.config.schema import load_config
    from plait.data.batches import check_source
    from plait.data.corpus import MANIFEST, SAMPLE_IDS, CorpusError

    manifest = json.loads((blocky / MANIFEST).read_text())
    del manifest["block_bytes"], manifest["checksums"]
    (blocky / MANIFEST).write_text(json.dumps(manifest))
    shard = blocky / "shard-00000.bin"
    ids = np.fromfile(shard, dtype=np.uint16)
    bad = 3 * SAMPLE_IDS + 17  # between the sampled blocks of ids (the first and the last)
    ids[bad] = 300
    ids.tofile(shard)
    cfg = load_config(None, [f"data.source={blocky}", "data.seq_len=64"])
    assert "has no block checksums" in check_source(cfg.data, 256, 64)
    data = TokenData(cfg.data, seed=0, vocab_size=256)
    with pytest.raises(CorpusError, match=rf"data.source: token id 300 at id {bad} of {shard} "
                       r"is >= 256"):
        for step in range(10_000):
            data.batch(step, 64)


def test_documents_of_a_window_follow_the_prepared_corpus(corpus):
    """`data.document_mask`: each input token's document in its window, from the prepared
    folder's `documents.npy`. Here document i is the hex digit of i repeated, so a document
    begins exactly where the id changes; numbered from 0 in each window, and each rank's rows'
    documents are the whole batch's rows."""
    import torch

    data = TokenData(DataConfig(source=corpus, seq_len=32, document_mask=True), seed=0)
    for step in range(3):
        x, _, ids = data.batch(step, 16)
        new = torch.zeros_like(x, dtype=torch.bool)
        new[:, 1:] = x[:, 1:] != x[:, :-1]
        assert torch.equal(ids, new.long().cumsum(1)), step
        parts = [data.batch(step, 16, r, 4)[2] for r in range(4)]
        assert torch.equal(torch.cat(parts), ids)
    assert (ids[:, -1] > 0).any()  # some window holds a boundary: the test can fail


def test_a_model_hf_folder_is_not_asked_for_a_number(tmp_path):
    """A corpus with more token ids than the model has: model.vocab_size is a number to raise;
    a model.hf folder's vocabulary is its own, so the fix is the model's tokenizer, not
    "set model.hf (/path) >= 256"."""
    from plait.config.schema import ConfigError, load_config
    from plait.data.batches import check_source

    text = tmp_path / "t.txt"
    text.write_text("plait " * 2000)
    cfg = load_config(None, [f"data.source={text}", "data.seq_len=16"])
    with pytest.raises(ConfigError) as number:
        check_source(cfg.data, 100, 1, "model.vocab_size")
    assert str(number.value).endswith("set model.vocab_size >= 256")
    with pytest.raises(ConfigError) as folder:
        check_source(cfg.data, 100, 1, "model.hf (/m)")
    assert folder.value.field == "model.hf (/m)" and ">=" not in str(folder.value)
    assert str(folder.value).endswith("prepare the corpus with the model's own tokenizer")
