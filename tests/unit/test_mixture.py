"""A weighted mixture of prepared corpora (`data.sources`, plait/data/mixture.py): rows drawn in
proportion to the weights, each source by its own epochs, the same batches at any number of
ranks, and a reweighing on resume that keeps what each source gave."""

import numpy as np
import pytest

from plait.config.schema import ConfigError, DataConfig, load_config
from plait.data.batches import TokenData
from plait.data.mixture import Mixture, check_sources, mixture_history
from plait.data.tokenize_corpus import prepare

SEQ = 32


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two byte corpora told apart by their ids: "web" holds only 'a'-'e', "code" only 'v'-'z'
    (and the newlines between documents); "web" is 4 times "code"'s size."""
    root = tmp_path_factory.mktemp("mixture")
    for name, letters, docs in (("web", "abcde", 16), ("code", "vwxyz", 4)):
        (root / name).mkdir()
        for i in range(docs):
            (root / name / f"{i}.txt").write_text(letters * 200)
        prepare([str(root / name)], str(root / f"{name}_ids"), "bytes", progress=False)
    return root


def _cfg(corpora, web: float = 0.25, code: float = 0.75) -> DataConfig:
    return DataConfig(seq_len=SEQ, sources=[
        {"path": str(corpora / "web_ids"), "weight": web, "name": "web"},
        {"path": str(corpora / "code_ids"), "weight": code, "name": "code"}])


def _from_web(inputs) -> np.ndarray:
    """Which rows are web's: ids of 'a'-'e' (code's are 'v'-'z'; a newline is either's)."""
    ids = inputs.numpy()
    web = ((ids >= ord("a")) & (ids <= ord("e"))).any(axis=1)
    code = ((ids >= ord("v")) & (ids <= ord("z"))).any(axis=1)
    assert not (web & code).any()  # no row mixes sources
    return web


def test_a_quarter_and_three_quarters_of_the_tokens_over_400_steps(corpora):
    """Counted from the rows themselves: 25% / 75% within 1% (the golden-ratio table holds any
    run of rows to its weights within a few rows), and the metrics say the same."""
    data, batch = Mixture(_cfg(corpora), seed=0), 32
    web = sum(int(_from_web(data.batch(step, batch)[0]).sum()) for step in range(400))
    assert web / (400 * batch) == pytest.approx(0.25, abs=0.01)
    metrics = data.metrics(400, batch)
    assert metrics["tokens/web"] == web * SEQ
    assert metrics["tokens/code"] == (400 * batch - web) * SEQ
    windows = {name: TokenData(DataConfig(source=str(corpora / f"{name}_ids"), seq_len=SEQ),
                               0).train_windows for name in ("web", "code")}
    assert metrics["epoch/code"] == pytest.approx((400 * batch - web) / windows["code"])
    assert metrics["epoch/code"] > 10 * metrics["epoch/web"]  # the small source repeats sooner


def test_each_source_visits_its_windows_once_per_epoch_of_its_own(corpora):
    data, batch = Mixture(_cfg(corpora), seed=5), 16
    source, visit = data._dealt(np.arange(300 * batch))
    for k, part in enumerate(data.parts):
        mine = np.sort(visit[source == k])
        assert np.array_equal(mine, np.arange(len(mine)))  # its own sequence, no gap, no repeat
        w = part.train_windows
        first_epoch = part.windows_at(np.arange(w))
        assert np.array_equal(np.sort(first_epoch), np.arange(w))


@pytest.mark.parametrize("ranks,microbatches", [(4, 1), (2, 2)])
def test_the_same_batches_at_any_number_of_ranks(corpora, ranks, microbatches):
    data = Mixture(_cfg(corpora), seed=1)
    for step in (0, 13, 400):
        whole = data.batch(step, 8)[0].view(microbatches, ranks, -1, SEQ)
        for r in range(ranks):
            part = data.batch(step, 8, r, ranks, microbatches)[0]
            assert np.array_equal(part.view(microbatches, -1, SEQ), whole[:, r])


def test_reweighed_on_resume_the_rows_before_stay_and_each_source_continues(corpora):
    """From step 100 on, half and half: the first 100 steps are the unchanged mixture's, and
    each source goes on with its next row (nothing skipped or repeated)."""
    batch = 16
    before = Mixture(_cfg(corpora), seed=2)
    history = [[0, {"web": 0.25, "code": 0.75}], [100, {"web": 0.5, "code": 0.5}]]
    after = Mixture(_cfg(corpora, 0.5, 0.5), seed=2, history=history, global_batch=batch)
    for step in (0, 57, 99):
        assert np.array_equal(before.batch(step, batch)[0], after.batch(step, batch)[0])
    source, visit = after._dealt(np.arange(300 * batch))
    for k in range(2):
        assert np.array_equal(np.sort(visit[source == k]), np.arange((source == k).sum()))
    late = source[200 * batch :]
    assert (late == 0).mean() == pytest.approx(0.5, abs=0.02)
    given = after.rows_given(300, batch)
    assert given.tolist() == np.bincount(source, minlength=2).tolist()


def test_a_resume_says_a_changed_mixture_once(corpora, tmp_path):
    import json

    ck = tmp_path / "step-00000100"
    ck.mkdir()
    (ck / "plait.json").write_text(json.dumps({"step": 100, "data_mixture": [
        [0, {"web": 0.25, "code": 0.75}]]}))
    history, said = mixture_history(_cfg(corpora, 0.5, 0.5), ck)
    assert history == [[0, {"web": 0.25, "code": 0.75}], [100, {"web": 0.5, "code": 0.5}]]
    assert said == "data.sources reweighed from step 100: code 0.5 (was 0.75), web 0.5 (was 0.25)"
    assert mixture_history(_cfg(corpora), ck) == ([[0, {"web": 0.25, "code": 0.75}]], "")


def test_sources_tokenized_otherwise_are_refused(corpora, tmp_path):
    (tmp_path / "words.txt").write_text(" ".join(f"w{i * 7919 % 1000}" for i in range(5000)))
    prepare([str(tmp_path / "words.txt")], str(tmp_path / "bpe"), "bpe:300", progress=False)
    cfg = DataConfig(seq_len=SEQ, sources=[{"path": str(corpora / "web_ids"), "weight": 1},
                                           {"path": str(tmp_path / "bpe"), "weight": 1}])
    with pytest.raises(ConfigError, match=r"data.sources\[1\].path: .* was tokenized otherwise"):
        check_sources(cfg, 512, "model.vocab_size")
    assert check_sources(_cfg(corpora), 256, "model.vocab_size") == ""


def test_sources_parse_from_a_command_line():
    cfg = load_config(None, ['data.sources=[{path = "/a", weight = 1}, {path = "/b", weight = 3, '
                             'name = "b"}]'])
    assert cfg.data.sources == [{"path": "/a", "weight": 1}, {"path": "/b", "weight": 3,
                                                              "name": "b"}]


def test_a_source_dropped_on_resume_keeps_the_others_counts(corpora):
    """Three sources until step 50, then two: the two go on from the rows they gave (their own
    sequences unbroken), and the dropped one gives no row after."""
    batch = 16
    history = [[0, {"web": 1.0, "code": 1.0, "books": 2.0}], [50, {"web": 0.5, "code": 0.5}]]
    data = Mixture(_cfg(corpora, 0.5, 0.5), seed=4, history=history, global_batch=batch)
    source, visit = data._dealt(np.arange(100 * batch))
    assert set(source[50 * batch :].tolist()) == {0, 1}
    for k in range(2):
        assert np.array_equal(np.sort(visit[source == k]), np.arange((source == k).sum()))
    assert data.rows_given(100, batch).tolist() == np.bincount(source, minlength=3)[:2].tolist()
    assert (source[: 50 * batch] == 2).mean() == pytest.approx(0.5, abs=0.02)
