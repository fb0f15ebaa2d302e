"""CUDA graph capture is refused wherever noise could be captured
(ncdp_fast/torch/graphs.py, csrc/common/cuda_check.h).

A graph replays its kernels with the seed and offset they were captured with:
the same noise at every replay, and no Python to account the step.  On a GPU
the capture is torch.cuda.graph's; on the emulated device the emulator's
switch (NCDP_EMU_STREAM_CAPTURING=1) makes every stream report one, so the
same launchers, hooks and step are refused in CI.
"""
from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ncdp_fast as nf  # noqa: E402
from ncdp_fast import _native  # noqa: E402
from conftest import emulated  # noqa: E402

pytestmark = pytest.mark.gpu

REFUSED = "capturing a CUDA graph"

# Every native launcher that draws from the Philox stream (a `seed` argument).
DRAWING_LAUNCHERS = {
    "launch_fill_gaussian", "launch_finish_gaussian_segments", "launch_clip_noise_rows",
    "launch_weighted_row_sum_noise", "launch_clipped_linear_sum", "launch_sample_counts",
    "launch_sample_fill", "launch_mix_rows",
}


@contextlib.contextmanager
def capturing(device, monkeypatch):
    """The current stream captures a graph within the block."""
    if emulated(device):
        monkeypatch.setenv("NCDP_EMU_STREAM_CAPTURING", "1")
        try:
            yield
        finally:
            monkeypatch.delenv("NCDP_EMU_STREAM_CAPTURING")
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    import warnings
    with warnings.catch_warnings():
        # A capture refused before its first launch leaves an empty graph.
        warnings.simplefilter("ignore", UserWarning)
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side):
            yield
    torch.cuda.current_stream().wait_stream(side)


def _native_module(device):
    return _native.emulated() if emulated(device) else _native.load()


def _signature(fn) -> list[tuple[str, str]]:
    """pybind11's (name, type) pairs of a launcher, from its docstring."""
    head = fn.__doc__.splitlines()[0]
    inside = head[head.index("(") + 1:head.rindex(")")]
    return [tuple(p.split(": ", 1)) for p in re.split(r", (?![^\[]*\])", inside)]


def _zero(kind: str):
    """An empty value of a pybind11 type as either of its spellings names it
    ("List[int]" or "collections.abc.Sequence[typing.SupportsInt | ...]")."""
    if "[" in kind:
        return []
    if "bool" in kind:
        return False
    return 0.0 if "float" in kind.lower() else 0


def _empty_call(fn, stream: int) -> list:
    """Arguments of an empty launch: null pointers and zero sizes, the stream."""
    return [stream if name == "stream" else _zero(kind) for name, kind in _signature(fn)]


def _stream(device) -> int:
    return 0 if emulated(device) else torch.cuda.current_stream().cuda_stream


def test_every_drawing_launcher_refuses_a_capturing_stream_first(require_cuda, monkeypatch):
    """Each launcher with a seed refuses a capturing stream before reading its
    other arguments (an empty launch is refused too), naming itself and the
    stream; outside a capture the same empty launch says nothing of graphs."""
    C = _native_module(require_cuda)
    drawing = {name for name in dir(C) if name.startswith("launch_")
               and "seed" in dict(_signature(getattr(C, name)))}
    assert drawing == DRAWING_LAUNCHERS
    for name in sorted(drawing):
        fn = getattr(C, name)
        try:
            fn(*_empty_call(fn, _stream(require_cuda)))
        except ValueError as exc:       # an argument check of the empty call
            assert REFUSED not in str(exc)
        with capturing(require_cuda, monkeypatch):
            with pytest.raises(ValueError, match=f"{name[len('launch_'):]}: stream: .*{REFUSED}"):
                fn(*_empty_call(fn, _stream(require_cuda)))


# The eager draws after the capture repeat the first on purpose.
@pytest.mark.filterwarnings("ignore::ncdp_fast.NoiseReuseWarning")
def test_the_ops_refuse_under_capture_and_draw_eagerly_after(require_cuda, monkeypatch):
    """The public ops that draw refuse before their first launch or read back
    (mix's refusal comes before its read of the labels to the host, which
    under a real capture would break the capture with torch's own error);
    after the capture the same calls draw as before."""
    g = torch.randn(6, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g = g.to(require_cuda)
    x = torch.randn(12, 5, dtype=torch.float64).to(require_cuda)
    y = (torch.arange(12) % 3).to(require_cuda)
    calls = {
        "clip_and_noise": lambda: nf.clip_and_noise(g, max_norm=1.0, noise_multiplier=1.0,
                                                    seed=3, offset=0).grad,
        "gaussian": lambda: nf.gaussian(64, seed=3, offset=0, dtype=np.float64, like=g),
        "mix": lambda: nf.mix(x, y, num_samples=4, mixup_degree=2, noise_std_x=1.0,
                              noise_std_y=1.0, num_classes=3, seed=3, offset=0).x,
    }
    for name, call in calls.items():
        before = call().clone()
        with capturing(require_cuda, monkeypatch):
            with pytest.raises(ValueError, match=f"^{name}: expected a current CUDA stream "
                                                 "that is not capturing a graph"):
                call()
        assert torch.equal(call(), before), name


def _mlp_step(device, noise_multiplier=1.0):
    from ncdp_fast.torch import GhostClipper
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double().to(device)
    clipper = GhostClipper(model, max_grad_norm=0.5, noise_multiplier=noise_multiplier,
                           expected_batch_size=6.0, seed=5)
    x = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return model, clipper, x.to(device), (torch.arange(6) % 3).to(device)


def test_a_recorded_forward_under_capture_is_refused_and_the_clipper_goes_on(require_cuda,
                                                                             monkeypatch):
    """make_graphed_callables / torch.cuda.graph around the model's training
    forward: refused at the forward, before the clipper's state moves; the
    eager step that follows (noiseless, to compare) equals a clipper's that
    never saw the capture, and takes its stream range from the same offset."""
    model, clipper, x, y = _mlp_step(require_cuda, noise_multiplier=0.0)
    before = clipper.offset
    with capturing(require_cuda, monkeypatch):
        with pytest.raises(RuntimeError, match=f"recorded forward: .*{REFUSED}"):
            model(x)
    F.cross_entropy(model(x), y).backward()
    assert clipper.privatize_().offset == before
    model2, clipper2, _, _ = _mlp_step(require_cuda, noise_multiplier=0.0)
    F.cross_entropy(model2(x), y).backward()
    clipper2.privatize_()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_an_evaluation_forward_may_be_captured(require_cuda, monkeypatch):
    """Nothing is recorded in evaluation mode or without grad, so nothing is
    refused (on a GPU the capture itself needs torch's warm-up: the emulated
    device checks the hook's decision)."""
    if not emulated(require_cuda):
        pytest.skip("the hook's decision is checked on the emulated device; a real capture "
                    "of an evaluation forward needs torch's side-stream warm-up")
    model, _, x, _ = _mlp_step(require_cuda)
    with capturing(require_cuda, monkeypatch):
        with torch.no_grad():
            model(x)
        model.eval()
        model(x)


@pytest.mark.parametrize("call", ["privatize_", "accumulate_"])
def test_a_step_under_capture_is_refused_with_nothing_drawn(require_cuda, monkeypatch, call):
    """A captured optimizer.step() (DPOptimizer.step calls privatize_): refused
    before the stream position moves; the same step then runs eagerly."""
    model, clipper, x, y = _mlp_step(require_cuda)
    F.cross_entropy(model(x), y).backward()
    before = clipper.offset
    with capturing(require_cuda, monkeypatch):
        with pytest.raises(RuntimeError, match=f"the step: .*{REFUSED}"):
            getattr(clipper, call)()
    assert clipper.offset == before
    getattr(clipper, call)()
