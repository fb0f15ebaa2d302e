"""The host-time shortcuts of issue 36 behave as the calls they replace: a
recorded layer output's gradient hook entered without ``Tensor.register_hook``
(recorder._add_grad_hook), the clip op's GEMMs run without a TF32 context
of their own inside the op's one (``ieee_float32_matmul_held``), a linear
pair's weight and bias sums share one allocation and one noise segment, and
the clip ops' argument checks are kept for plain values that passed them
(``_clip_checks._check_common``) without letting any other value through."""
from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.overrides import TorchFunctionMode  # noqa: E402

from ncdp_fast import NoiseReuseWarning  # noqa: E402
from ncdp_fast._cuda import _common  # noqa: E402
from ncdp_fast.torch.recorder import _add_grad_hook  # noqa: E402


def _output():
    x = torch.randn(3, 4, requires_grad=True)
    return x, x * 2.0


def test_grad_hook_fires_with_the_gradient_as_register_hook_does():
    """Ours and a user's register_hook, either order, on a non-leaf: both see
    the same gradient, and a hook that returns a value replaces it for what
    follows, as with two register_hook calls."""
    for ours_first in (True, False):
        x, y = _output()
        seen = []
        if ours_first:
            _add_grad_hook(y, lambda g: seen.append(("ours", g.clone())))
            y.register_hook(lambda g: seen.append(("user", g.clone())) or g * 3.0)
        else:
            y.register_hook(lambda g: seen.append(("user", g.clone())) or g * 3.0)
            _add_grad_hook(y, lambda g: seen.append(("ours", g.clone())))
        y.sum().backward()
        names = [n for n, _ in seen]
        assert names == (["ours", "user"] if ours_first else ["user", "ours"])
        first, second = seen[0][1], seen[1][1]
        assert torch.equal(first, torch.ones(3, 4))
        # the user's hook multiplies by 3 what later hooks and x see
        assert torch.equal(second, torch.ones(3, 4) * (1.0 if ours_first else 3.0))
        assert torch.equal(x.grad, torch.full((3, 4), 6.0))


def test_grad_hook_keys_are_the_handles_so_a_user_handle_removes_only_its_own():
    """Our entry takes a key from the handles' counter: a user's hook
    registered next gets another key, and removing it leaves ours."""
    x, y = _output()
    seen = []
    _add_grad_hook(y, lambda g: seen.append("ours"))
    handle = y.register_hook(lambda g: seen.append("user"))
    assert len(y._backward_hooks) == 2
    handle.remove()
    y.sum().backward()
    assert seen == ["ours"]


def test_grad_hook_goes_through_register_hook_where_torch_would_dispatch():
    """Under an active torch-function mode (``with torch.device(...)`` is one)
    the mode sees Tensor.register_hook, as it does for a plain call."""
    called = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            called.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x, y = _output()
    seen = []
    with Spy():
        _add_grad_hook(y, lambda g: seen.append(g.shape))
    assert "register_hook" in called
    y.sum().backward()
    assert seen == [torch.Size([3, 4])]


def test_matmul_held_is_this_threads_and_nests():
    assert not _common.ieee_float32_matmul_held()
    with _common.ieee_float32_matmul():
        assert _common.ieee_float32_matmul_held()
        with _common.ieee_float32_matmul():
            assert _common.ieee_float32_matmul_held()
        assert _common.ieee_float32_matmul_held()
        other = []
        t = threading.Thread(target=lambda: other.append(_common.ieee_float32_matmul_held()))
        t.start()
        t.join()
        assert other == [False]
    assert not _common.ieee_float32_matmul_held()


@pytest.mark.parametrize("K, d", [(3, 5), (5, 3)])
def test_clip_op_gemms_run_without_tf32_inside_its_entry(tf32_on_matmuls, K, d):
    """The layered op on the emulated device with TF32 on globally: every
    torch GEMM of its sums (weight and GEMV bias, both sides of K <= d) sees
    TF32 off, and the caller's setting is back afterwards (the fixture)."""
    import ncdp_fast._backend as be
    from ncdp_fast import clip_and_noise_layers
    rng = np.random.default_rng(3)
    layers = [(torch.from_numpy(rng.standard_normal((4, 2, d)).astype(np.float32)),
               torch.from_numpy(rng.standard_normal((4, 2, K)).astype(np.float32)), True)
              for _ in range(2)]
    with be.emulated_cuda():
        r = clip_and_noise_layers(layers, max_norm=1.0, noise_multiplier=0.0, seed=1)
    assert len(r.grads) == 2 and tf32_on_matmuls and not any(tf32_on_matmuls)


# (T, d, K, bias): both sides of K <= d (the factor in g: the bias from the
# GEMM's scaled rows; in a: the bias by the GEMV, or from float64 sums where a
# weight is out of range), T = 1 and T > 1, a pair without a bias.
PAIRS = [(1, 5, 3, True), (3, 5, 3, True), (3, 3, 5, True), (2, 4, 6, False)]


@pytest.mark.parametrize("weights", ["in range", "one tiny"])
def test_pair_sums_share_one_allocation_and_one_finish_segment(monkeypatch, weights):
    """On the (emulated) device a linear pair's weight and bias sums are one
    allocation, finished as one noise segment where both are finished in
    place: the same bits as two segments (the same draws at the same
    offsets), one segment fewer for each such pair, and the bias a view
    right after the weight."""
    import ncdp_fast._backend as be
    import ncdp_fast._clip_layers as cl
    from ncdp_fast import clip_and_noise_layers
    from ncdp_fast._cuda import clip as device_clip
    rng = np.random.default_rng(11)
    layers = []
    for T, d, K, bias in PAIRS:
        a = rng.standard_normal((4, T, d)).astype(np.float32)
        g = rng.standard_normal((4, T, K)).astype(np.float32)
        layers.append((torch.from_numpy(a), torch.from_numpy(g), bias))
    # A tiny weight (a sample's factor below 2^-40) sends a GEMV bias to its
    # float64 sums: that bias is finished from a float64 source, not merged.
    scale = 1e-13 if weights == "one tiny" else 1.0
    layers[0][1][0] *= 1.0 / scale
    counts = []
    finish = device_clip.finish_gaussian_segments

    def counted(segments, *args):
        counts.append(len(segments))
        return finish(segments, *args)

    monkeypatch.setattr(device_clip, "finish_gaussian_segments", counted)
    runs = []
    for merge in (True, False):
        if not merge:
            monkeypatch.setattr(cl, "_in_place_pair", lambda *args: False)
        with be.emulated_cuda(), (contextlib.nullcontext() if merge else
                                  pytest.warns(NoiseReuseWarning)):     # the same draws again
            runs.append(clip_and_noise_layers(list(layers), max_norm=1.0, noise_multiplier=1.3,
                                              seed=7, offset=5).grads)
    merged, separate = runs
    for (gw, gb), (sw, sb) in zip(merged, separate):
        assert torch.equal(gw, sw) and (gb is None and sb is None or torch.equal(gb, sb))
    with_bias = [(gw, gb) for gw, gb in merged if gb is not None]
    for gw, gb in with_bias:
        assert gb.untyped_storage().data_ptr() == gw.untyped_storage().data_ptr()
        assert gb.data_ptr() == gw.data_ptr() + gw.numel() * gw.element_size()
    fewer = counts[1] - counts[0]
    if weights == "in range":       # every bias finished in place: every pair merges
        assert fewer == len(with_bias) == 3, counts
    else:                           # at least the GEMV side's bias from float64 sums
        assert 0 <= fewer < len(with_bias), counts


def test_kept_checks_return_the_checks_result_and_never_pass_a_bad_value(monkeypatch):
    """A kept key returns what the checks return; a value of another type,
    a zero, a non-plain value and a failing value are checked every time
    (a failing one still raises after a passing one was kept)."""
    from ncdp_fast import _clip_checks as cc
    monkeypatch.setattr(cc, "_PASSED", {})
    calls = []
    real = cc._checked_common

    def counted(*key):
        calls.append(key)
        return real(*key)
    monkeypatch.setattr(cc, "_checked_common", counted)
    good = (1.5, 2.0, "mean", 64.0, "raise")
    assert cc._check_common(*good) == real(*good) == (1.5, 3.0, 1.0 / 64.0)
    assert cc._check_common(*good) == real(*good)
    assert len(calls) == 1                          # the second call was kept
    # 1.5 == 1.5 but 2 is not 2.0's type: checked and kept anew.
    assert cc._check_common(1.5, 2, "mean", 64.0, "raise") == (1.5, 3.0, 1.0 / 64.0)
    assert len(calls) == 2
    # A zero, a NumPy float (a float subclass) and a 0-d array: never kept.
    held = np.array(1.5)
    for key in [(1.5, 0.0, "sum", None, "raise"), (1.5, -0.0, "sum", None, "raise"),
                (np.float64(1.5), 2.0, "sum", None, "raise"), (held, 2.0, "sum", None, "raise")]:
        n = len(calls)
        cc._check_common(*key)
        cc._check_common(*key)
        assert len(calls) == n + 2, key
    held[()] = 4.0                                  # changed in place: checked anew
    assert cc._check_common(held, 2.0, "sum", None, "raise") == (4.0, 8.0, 1.0)
    noise = cc._check_common(1.5, -0.0, "sum", None, "raise")[1]
    assert str(noise) == "-0.0"                     # -0.0 * 1.5, not a kept +0.0
    for bad, match in [((-1.0, 2.0, "sum", None, "raise"), "max_norm"),
                       ((1.5, 2.0, "mean", None, "raise"), "expected_batch_size"),
                       ((1.5, 2.0, "avg", None, "raise"), "reduction"),
                       ((1.5, 2.0, "sum", None, "skip"), "nan_policy"),
                       ((float("nan"), 2.0, "sum", None, "raise"), "max_norm"),
                       ((True, 2.0, "sum", None, "raise"), "max_norm")]:
        for _ in range(2):
            with pytest.raises((ValueError, TypeError), match=match):
                cc._check_common(*bad)
    # Bounded: the kept keys never exceed _PASSED_MAX.
    for i in range(3 * cc._PASSED_MAX):
        cc._check_common(1.0 + i, 1.0, "sum", None, "raise")
    assert 0 < len(cc._PASSED) <= cc._PASSED_MAX
