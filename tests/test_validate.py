"""The one argument-check convention (ncdp_fast._validate): ``check_xxx(value, name)``
returns the normalised value; TypeError for a wrong type, ValueError for a wrong
value; the message names the argument, the expectation and what came."""
import math

import numpy as np
import pytest

from ncdp_fast import _validate as v

NUMBER_CHECKS = [
    (v.check_real, {}),
    (v.check_finite, {}),
    (v.check_positive, {}),
    (v.check_nonneg, {}),
    (v.check_probability, {}),
    (v.check_delta, {}),
]
INT_CHECKS = [
    (v.check_int, {}),
    (v.check_int, {"minimum": 0}),
    (v.check_pos_int, {}),
    (v.check_uint64, {}),
]


@pytest.mark.parametrize("check,kw", NUMBER_CHECKS)
@pytest.mark.parametrize("bad", ["0.5", None, True, np.bool_(False), [0.5], 1j])
def test_number_checks_type_error_names_argument_and_value(check, kw, bad):
    with pytest.raises(TypeError) as e:
        check(bad, "my_arg", **kw)
    msg = str(e.value)
    assert msg.startswith("my_arg: expected ")
    assert repr(bad) in msg and type(bad).__name__ in msg


@pytest.mark.parametrize("check,kw", INT_CHECKS)
@pytest.mark.parametrize("bad", [1.0, 2.5, "3", None, True, np.float64(4.0)])
def test_int_checks_type_error_for_floats_bools_and_strings(check, kw, bad):
    with pytest.raises(TypeError) as e:
        check(bad, "my_int", **kw)
    msg = str(e.value)
    assert msg.startswith("my_int: expected an integer")
    assert repr(bad) in msg


@pytest.mark.parametrize("check,bad,expect", [
    (v.check_real, math.nan, "a real number"),
    (v.check_finite, math.inf, "a finite number"),
    (v.check_finite, math.nan, "a real number"),
    (v.check_positive, 0.0, "a finite number > 0"),
    (v.check_positive, -1.0, "a finite number > 0"),
    (v.check_positive, math.inf, "a finite number > 0"),
    (v.check_nonneg, -1e-300, "a finite number >= 0"),
    (v.check_nonneg, math.inf, "a finite number >= 0"),
    (v.check_probability, 0.0, "a number in (0, 1]"),
    (v.check_probability, 1.5, "a number in (0, 1]"),
    (v.check_delta, 1.0, "a number in (0, 1)"),
    (v.check_delta, 0, "a number in (0, 1)"),
    (v.check_pos_int, 0, "an integer >= 1"),
    (v.check_pos_int, -3, "an integer >= 1"),
    (v.check_uint64, -1, "an integer in [0, 2**64)"),
    (v.check_uint64, 2**64, "an integer in [0, 2**64)"),
])
def test_value_error_names_argument_expectation_and_value(check, bad, expect):
    with pytest.raises(ValueError) as e:
        check(bad, "arg_x")
    msg = str(e.value)
    assert msg.startswith(f"arg_x: expected {expect}")
    assert msg.endswith(f"got {bad!r}" if not isinstance(bad, int) else f"got {bad}")


def test_int_minimum_and_choice_value_errors():
    with pytest.raises(ValueError, match=r"^k: expected an integer >= 2, got 1$"):
        v.check_int(1, "k", 2)
    with pytest.raises(ValueError, match=r"^mode: expected one of \['a', 'b'\], got 'c'$"):
        v.check_choice("c", "mode", ("a", "b"))
    with pytest.raises(TypeError, match=r"^mode: expected one of \['a', 'b'\], got list \[\]$"):
        v.check_choice([], "mode", ("a", "b"))


def test_draw_range():
    assert v.check_draw_range(2**64 - 3, 3) == 2**64 - 3
    with pytest.raises(ValueError, match=r"^offset: expected offset \+ draws <= 2\*\*64, got "
                                         r"18446744073709551614 \+ 3 draws"):
        v.check_draw_range(2**64 - 2, 3)


def test_probability_ends_and_delta_default_name():
    assert v.check_probability(0.0, "p", zero=True) == 0.0
    assert v.check_probability(1.0, "p") == 1.0
    with pytest.raises(ValueError, match=r"^p: expected a number in \[0, 1\), got 1.0$"):
        v.check_probability(1.0, "p", zero=True, one=False)
    with pytest.raises(ValueError, match=r"^delta: "):
        v.check_delta(2.0)


def test_normalised_return_values():
    assert type(v.check_real(np.float32(0.5), "x")) is float
    assert v.check_real(np.array(2.0), "x") == 2.0
    assert type(v.check_positive(np.int64(3), "x")) is float
    assert v.check_positive(math.inf, "x", finite=False) == math.inf
    assert type(v.check_nonneg(0, "x")) is float
    assert type(v.check_int(np.int32(7), "x")) is int
    assert v.check_uint64(np.uint64(2**64 - 1), "seed") == 2**64 - 1
    assert v.check_choice("b", "mode", ("a", "b")) == "b"


def test_array_checks_convention():
    with pytest.raises(TypeError, match=r"^X: expected an array"):
        v.check_features([[1.0, 2.0]], "X")
    with pytest.raises(ValueError, match=r"^X: expected shape \(n, p\), got \(3,\)$"):
        v.check_features(np.zeros(3), "X")
    with pytest.raises(TypeError, match=r"^X: expected a real-valued array, got dtype <U1$"):
        v.check_features(np.array([["a"]]), "X")
    with pytest.raises(ValueError, match=r"^X: expected finite features, got NaN or Inf$"):
        v.check_features(np.array([[np.nan]]), "X")
    assert v.check_features(np.zeros((2, 3), np.int32), "X") == (2, 3)
    with pytest.raises(TypeError, match=r"^y: expected integer class labels, got dtype <U1"):
        v.check_labels(np.array(["a", "b"]), 2)
    with pytest.raises(ValueError, match=r"^y: expected integers in \[0, 2\), "
                       r"got values outside it \(not shown: labels are private\)$"):
        v.check_labels(np.array([0, 2]), 2, num_classes=2)
    with pytest.raises(TypeError, match=r"^num_classes: expected an integer >= 2, got float"):
        v.check_labels(np.array([0, 1]), 2, num_classes=2.0)
    with pytest.raises(ValueError, match=r"^x: expected a 2-D array \(n, d\), got shape \(2,\)$"):
        v.as_matrix([1.0, 2.0], "x")
    with pytest.raises(ValueError, match=r"^x: expected finite values, got NaN or Inf$"):
        v.as_matrix([[np.inf]], "x")
    with pytest.raises(ValueError, match=r"^y: expected shape \(3,\)"):
        v.as_targets([1.0, 2.0], 3)


def test_array_checks_on_torch():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^X: expected a float32/float64 tensor"):
        v.check_features(torch.zeros(2, 2, dtype=torch.int64), "X")
    with pytest.raises(ValueError, match=r"^X: expected finite features"):
        v.check_features(torch.full((2, 2), float("inf")), "X")
    assert v.check_features(torch.zeros(2, 3, dtype=torch.bfloat16), "X") == (2, 3)
    with pytest.raises(ValueError, match=r"^X: expected finite features"):
        v.check_features(torch.full((2, 2), float("nan"), dtype=torch.bfloat16), "X")
    m = v.as_matrix(torch.ones(2, 2, requires_grad=True), "x")
    assert isinstance(m, np.ndarray) and m.dtype == np.float64
    labels, K = v.check_labels(torch.tensor([0, 1, 1]), 3)
    assert K == 2 and labels.dtype == np.int64


def test_one_convention_across_the_package():
    """Op, algorithm and accounting entry points raise the same types for the same mistakes."""
    import ncdp_fast
    from ncdp_fast._rng import gaussian
    from ncdp_fast.privacy import epsilon_poisson_gaussian
    with pytest.raises(TypeError, match=r"^count: expected an integer >= 0, got float 2.0$"):
        gaussian(2.0, seed=1, offset=0)
    with pytest.raises(TypeError, match=r"^steps: expected an integer >= 1, got float 10.0$"):
        epsilon_poisson_gaussian(1.0, 0.1, 10.0, 1e-5)
    with pytest.raises(ValueError, match=r"^noise_multiplier: expected a finite number > 0"):
        epsilon_poisson_gaussian(-1.0, 0.1, 10, 1e-5)
    with pytest.raises(TypeError, match=r"^seed: expected an integer in \[0, 2\*\*64\)"):
        ncdp_fast.NoiseStream(seed=1.5)


def test_flags_and_sizes_across_the_package_are_checked_before_use():
    """The sixth audit's leftovers: truthy strings passed as bool flags were
    taken as True (compress='no' compressed, overwrite='no' overwrote a
    release, fit_intercept='no' fitted a bias), like='x' fell through to NumPy,
    an n past int64 raised a bare OverflowError, a model without predict_proba
    an AttributeError, x with 0 columns a ZeroDivisionError, J='2' a bare
    comparison TypeError.  Each is now refused by name before anything is drawn
    or written."""
    import ncdp_fast as nf
    from ncdp_fast.audit import membership_auc
    from ncdp_fast.datasets._idx import write_idx
    from ncdp_fast.datasets._scatter import scattering_features
    from ncdp_fast.ntk.regress import random_features
    from ncdp_fast.release._directory import DirectoryWriter
    from ncdp_fast.release.classifier import SoftLabelClassifier
    from ncdp_fast.train import NoisyGDClassifier
    X = np.random.default_rng(0).standard_normal((6, 3))
    y = np.arange(6) % 2
    W = [np.ones((4, 3)), np.ones((1, 4))]
    stream = nf.NoiseStream()
    bool_cases = [
        ("diagonal", lambda: nf.ntk_gram(X, W, diagonal="no")),
        ("accumulate_f64", lambda: nf.ntk_gram(X, W, accumulate_f64=1)),
        ("return_groups", lambda: nf.mix(X, y, num_samples=2, mixup_degree=2, noise_std_x=1.0,
                                         noise_std_y=1.0, num_classes=2, return_groups="no",
                                         seed=stream)),
        ("fit_intercept", lambda: NoisyGDClassifier(rho=1.0, num_classes=2,
                                                    fit_intercept="no", seed=stream).fit(X, y)),
        ("standardize", lambda: SoftLabelClassifier(standardize="no")),
        ("compress", lambda: write_idx("/nonexistent/x.idx", np.ones(3, np.float32),
                                       compress="no")),
        ("overwrite", lambda: DirectoryWriter("/nonexistent/out", overwrite="no")),
    ]
    for name, call in bool_cases:
        with pytest.raises(TypeError, match=rf"^{name}: expected a bool \(True or False\), got"):
            call()
    assert stream.position == 0                     # nothing drawn by a refused call
    with pytest.raises(TypeError, match=r"^like: expected a NumPy array, torch tensor or CuPy "
                                        r"array .* got str"):
        nf.gaussian(3, seed=1, like="x")
    with pytest.raises(ValueError, match=r"^n: expected an integer >= 1 and <= "
                                         r"9223372036854775807, got 10+$"):
        nf.poisson_batches(10 ** 30, sample_rate=0.1, steps=1, seed=stream)
    with pytest.raises(TypeError, match=r"^model: expected a fitted classifier with "
                                        r"predict_proba.*got NoneType"):
        membership_auc(None, (X, y), (X, y))
    with pytest.raises(ValueError, match=r"^x: expected at least 1 column\(s\), got shape "
                                         r"\(3, 0\)"):
        random_features(np.ones((3, 0)), 4)
    with pytest.raises(TypeError, match=r"^J: expected an integer >= 1, got str '2'"):
        scattering_features(np.ones((2, 8, 8)), J="2")
    with pytest.raises(TypeError, match=r"^L: expected an integer >= 1, got float 2.0"):
        scattering_features(np.ones((2, 8, 8)), L=2.0)
    assert stream.position == 0
    assert v.check_bool(None, "f", none=True) is None
    with pytest.raises(ValueError, match=r"^k: expected an integer >= 0 and <= 3, got 4$"):
        v.check_int(4, "k", 0, 3)
