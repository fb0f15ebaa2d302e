"""Drop-ins for torch training loops (needs torch; the rest of ncdp_fast does not).

* :class:`FusedDPOptimizer` replaces Opacus's ``DPOptimizer``: it reads the
  per-sample gradients Opacus's ``GradSampleModule`` leaves in ``p.grad_sample``
  and clips, sums and noises all parameters in one fused op.
* :class:`GhostClipper` needs no per-sample gradients at all for models whose
  trainable parameters all sit in ``nn.Linear`` layers (a linear probe, an MLP
  head): hooks keep each layer's inputs and output gradients during one
  ordinary ``loss.backward()``, and :meth:`GhostClipper.privatize_` replaces
  every ``p.grad`` by the clipped, noised, reduced gradient.

Both follow Opacus's conventions for ``loss_reduction`` ("mean": the loss is the
batch mean, gradients are divided by the *expected* batch size) and keep the
Philox stream position (``seed``, ``offset``) so that no noise is ever reused.
"""
from __future__ import annotations

from typing import Any

try:
    import torch
    from torch import nn
except ImportError as exc:  # pragma: no cover - torch is an optional extra
    raise ImportError("ncdp_fast.torch needs PyTorch: pip install 'ncdp_fast[torch]'") from exc

from .. import _backend, _stream
from .._clip import LayersClipResult, _nonneg_finite, _positive_finite, clip_and_noise_layers
from .._stream import NoiseStream
from .._mix import poisson_batches

__all__ = ["FusedDPOptimizer", "GhostClipper", "PoissonBatchSampler", "collate_with_empty"]


class _UsesStream:
    """The noise stream of a drop-in (a :class:`ncdp_fast.NoiseStream`): ``seed``
    (the secret key), ``offset`` (the next unused draw) and the private-step count.
    ``noise_state()`` / ``load_noise_state()`` carry them into a *private*
    training checkpoint so that a resumed run continues the stream."""

    def _init_stream(self, seed, offset):
        self._stream = _stream.resolve(seed, offset)
        self._steps = 0

    @property
    def seed(self) -> int:
        return self._stream.seed

    @property
    def offset(self) -> int:
        """Next unused draw (or sub-stream) of the Philox stream."""
        return self._stream.position

    @property
    def steps(self) -> int:
        """Private steps taken (calls of privatize_, or passes over a sampler)."""
        return self._steps

    def noise_state(self) -> dict:
        """``{"seed", "offset", "steps"}``: secret, for private checkpoints only."""
        return dict(self._stream.state(), steps=self._steps)

    def load_noise_state(self, state: dict) -> None:
        if not isinstance(state, dict) or not {"seed", "offset", "steps"} <= set(state):
            raise ValueError(f"state: expected a dict with seed, offset and steps (from "
                             f"noise_state()), got {state!r}")
        self._stream = NoiseStream.restore(state)
        self._steps = int(state["steps"])


def _check_dp_args(max_grad_norm, noise_multiplier, expected_batch_size, loss_reduction,
                   nan_policy):
    """The drop-ins' arguments, checked at construction under the user's names."""
    max_grad_norm = _positive_finite(max_grad_norm, "max_grad_norm")
    noise_multiplier = _nonneg_finite(noise_multiplier, "noise_multiplier")
    if noise_multiplier * max_grad_norm > 1e150:
        raise ValueError(f"noise_multiplier: {noise_multiplier!r} * max_grad_norm "
                         f"{max_grad_norm!r} is too large a noise std (the noise would "
                         "overflow)")
    _check_reduction(loss_reduction)
    if expected_batch_size is not None:
        expected_batch_size = _positive_finite(expected_batch_size, "expected_batch_size")
    elif loss_reduction == "mean":
        raise ValueError("expected_batch_size: required with loss_reduction='mean'")
    if nan_policy not in ("raise", "zero"):
        raise ValueError(f"nan_policy: expected 'raise' or 'zero', got {nan_policy!r}")
    return max_grad_norm, noise_multiplier, expected_batch_size


def _check_reduction(loss_reduction):
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction: expected 'mean' or 'sum', got {loss_reduction!r}")
    return loss_reduction


class FusedDPOptimizer(_UsesStream):
    """DP-SGD step from Opacus per-sample gradients, in one fused clip-and-noise op.

    Wraps ``optimizer``; on :meth:`step` every trainable parameter's
    ``p.grad_sample`` (B, *p.shape) -- or the list of them Opacus accumulates
    over several backward passes, concatenated along the batch -- is clipped
    jointly (one factor per sample from the norm over all parameters, bound
    ``max_grad_norm``), summed, noised with std ``noise_multiplier *
    max_grad_norm`` and, with ``loss_reduction="mean"``, divided by
    ``expected_batch_size``; the result goes to ``p.grad`` and the wrapped
    optimizer steps.  Same semantics as ``opacus.optimizers.DPOptimizer`` except
    the clip factor ``min(1, C/||g||)`` (Opacus uses ``C/(||g|| + 1e-6)``).

    Privacy meaning: each step is a Gaussian mechanism with sensitivity
    ``max_grad_norm`` (add/remove one sample) and noise multiplier
    ``noise_multiplier``; account for it with ``ncdp_fast.privacy`` using your
    sampling rate.  ``expected_batch_size`` must be ``sample_rate * n``, not the
    realized batch size.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, noise_multiplier: float,
                 max_grad_norm: float, expected_batch_size: float | None,
                 loss_reduction: str = "mean", seed=None, offset: int | None = None,
                 nan_policy: str = "raise"):
        self.original_optimizer = optimizer
        self.max_grad_norm, self.noise_multiplier, self.expected_batch_size = _check_dp_args(
            max_grad_norm, noise_multiplier, expected_batch_size, loss_reduction, nan_policy)
        self.loss_reduction = loss_reduction
        self.nan_policy = nan_policy
        self._init_stream(seed, offset)
        self.params = [p for group in optimizer.param_groups for p in group["params"]
                       if p.requires_grad]
        self.last_result: LayersClipResult | None = None

    # --- optimizer protocol ----------------------------------------------------------
    @property
    def param_groups(self):
        return self.original_optimizer.param_groups

    @property
    def state(self):
        return self.original_optimizer.state

    def state_dict(self):
        """The wrapped optimizer's state plus ``"ncdp_noise"`` (:meth:`noise_state`):
        a training checkpoint resumes the noise stream where it stopped.  It holds
        the secret key -- keep checkpoints private, never publish them."""
        state = self.original_optimizer.state_dict()
        state["ncdp_noise"] = self.noise_state()
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        noise = state_dict.pop("ncdp_noise", None)
        self.original_optimizer.load_state_dict(state_dict)
        if noise is not None:
            self.load_noise_state(noise)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad_sample = None

    def _grad_samples(self):
        blocks = []
        for i, p in enumerate(self.params):
            gs = getattr(p, "grad_sample", None)
            if gs is None:
                raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) has no grad_sample: wrap "
                                 "the model in opacus.GradSampleModule and run backward first")
            if isinstance(gs, (list, tuple)):
                gs = torch.cat(list(gs), dim=0)
            if gs.dtype != p.dtype:
                gs = gs.to(p.dtype)
            blocks.append(gs)
        return blocks

    def privatize_(self) -> LayersClipResult:
        """Overwrite every ``p.grad`` with the private gradient; returns the clip result."""
        result = clip_and_noise_layers(
            self._grad_samples(), max_norm=self.max_grad_norm,
            noise_multiplier=self.noise_multiplier, seed=self._stream,
            reduction=self.loss_reduction,
            expected_batch_size=self.expected_batch_size, nan_policy=self.nan_policy)
        for p, g in zip(self.params, result.grads):
            p.grad = g.view_as(p)
            p.grad_sample = None
        self._steps += 1
        self.last_result = result
        return result

    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self.params:
            self.privatize_()
        return self.original_optimizer.step()

    def __repr__(self):
        return (f"FusedDPOptimizer(noise_multiplier={self.noise_multiplier}, "
                f"max_grad_norm={self.max_grad_norm}, expected_batch_size="
                f"{self.expected_batch_size}, {self.original_optimizer!r})")


class _CaptureGrad(torch.autograd.Function):
    """Identity on a layer's output whose backward hands the output gradient to
    ``store`` and passes it on unchanged.  Returns a copy, not a view: a view
    made in a custom Function may not be modified in place (an inplace ReLU
    after the layer would fail), and the copy (B x K) costs far less than the
    weight-gradient GEMM (B x K x d) it lets backward skip."""

    @staticmethod
    def forward(ctx, output, anchor, store):
        ctx.store = store
        return output.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.store(grad.detach())
        return grad, None, None


class _LinearTap:
    """Inputs and output gradients of one nn.Linear across the forward calls of a step."""

    def __init__(self, name: str, module: nn.Linear):
        self.name = name
        self.module = module
        self.has_bias = module.bias is not None and module.bias.requires_grad
        self.params = [module.weight] + ([module.bias] if self.has_bias else [])
        self.recording = False
        self.acts: list = []
        self.grads: dict[int, Any] = {}

    def clear(self):
        self.acts.clear()
        self.grads.clear()


def _as_sequence(x, width):
    """(B, ..., width) -> (B, T, width); explicit T so that B = 0 reshapes too."""
    T = 1
    for s in x.shape[1:-1]:
        T *= s
    return x.reshape(x.shape[0], T, width)


def _cat_calls(parts):
    """Several calls of a layer in one forward are one longer sequence; a single
    call is used as is (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class GhostClipper(_UsesStream):
    """Private gradients for all-``nn.Linear`` models with no per-sample gradient.

    Usage::

        clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.1,
                               expected_batch_size=256)
        loss = criterion(model(x), y)      # loss reduced by mean (or sum)
        loss.backward()                   # ordinary backward: hooks record a, g
        clipper.privatize_()              # p.grad <- clipped, noised, reduced
        optimizer.step()

    Every trainable parameter of ``model`` must be the weight or bias of an
    ``nn.Linear`` and appear in exactly one such layer; anything else (a
    trainable norm layer, an embedding, tied weights) raises at construction.
    Inputs may be (B, d) or (B, ..., d) (a sequence: every position is summed
    into the per-sample gradient), and a layer may run several times in one
    forward.  The per-sample norm over all layers is computed from the
    factored identities (DESIGN.md kernel 1) and the clipped sum is one GEMM
    per layer: memory O(B*(d+K)) per layer instead of O(B*K*d).

    Privacy meaning as :class:`FusedDPOptimizer`: each :meth:`privatize_` is one
    Gaussian mechanism (sensitivity ``max_grad_norm``, noise multiplier
    ``noise_multiplier``) over the batch; the realized batch size is used only
    to undo the mean of a mean-reduced loss, never to normalise the output.
    """

    def __init__(self, model: nn.Module, *, max_grad_norm: float, noise_multiplier: float,
                 expected_batch_size: float | None, loss_reduction: str = "mean",
                 seed=None, offset: int | None = None, nan_policy: str = "raise"):
        self.model = model
        self.max_grad_norm, self.noise_multiplier, self.expected_batch_size = _check_dp_args(
            max_grad_norm, noise_multiplier, expected_batch_size, loss_reduction, nan_policy)
        self.loss_reduction = loss_reduction
        self.nan_policy = nan_policy
        self._init_stream(seed, offset)
        self.taps = self._find_layers(model)
        # A leaf that requires grad, so that a layer's output enters the graph
        # (and its gradient reaches us) even when neither its input nor, during
        # the forward, its parameters require grad.
        self._anchor = torch.zeros((), requires_grad=True)
        self._handles = []
        for tap in self.taps:
            self._handles.append(tap.module.register_forward_pre_hook(self._pre_hook(tap)))
            self._handles.append(tap.module.register_forward_hook(self._forward_hook(tap),
                                                                  always_call=True))
        self.last_result: LayersClipResult | None = None

    @staticmethod
    def _find_layers(model: nn.Module) -> list[_LinearTap]:
        owner: dict[int, str] = {}
        taps = []
        for name, module in model.named_modules(remove_duplicate=False):
            for pname, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                full = f"{name}.{pname}" if name else pname
                if not isinstance(module, nn.Linear):
                    raise ValueError(f"GhostClipper: trainable parameter {full!r} belongs to "
                                     f"{type(module).__name__}; only nn.Linear layers are supported "
                                     "(freeze it, or use opacus.GradSampleModule + FusedDPOptimizer)")
                if id(p) in owner:
                    raise ValueError(f"GhostClipper: parameter {full!r} is shared with "
                                     f"{owner[id(p)]!r} (tied weights are not supported)")
                owner[id(p)] = full
            if isinstance(module, nn.Linear) and module.weight.requires_grad:
                if any(t.module is module for t in taps):
                    raise ValueError(f"GhostClipper: layer {name!r} appears twice in the model "
                                     "(shared modules are not supported)")
                taps.append(_LinearTap(name, module))
            elif isinstance(module, nn.Linear) and module.bias is not None \
                    and module.bias.requires_grad:
                raise ValueError(f"GhostClipper: layer {name!r} has a trainable bias but a frozen "
                                 "weight; not supported")
        if not taps:
            raise ValueError("GhostClipper: the model has no trainable nn.Linear layer")
        return taps

    def _pre_hook(self, tap: _LinearTap):
        def hook(module, inputs):
            # The weight (and bias) gradient of the ordinary backward would be
            # overwritten by privatize_(); switching requires_grad off for the
            # duration of this forward keeps autograd from computing it at all
            # (one GEMM of the size of the forward saved per layer).
            tap.recording = torch.is_grad_enabled()
            if tap.recording:
                for p in tap.params:
                    p.requires_grad_(False)
        return hook

    def _forward_hook(self, tap: _LinearTap):
        def hook(module, inputs, output):
            if not getattr(tap, "recording", False):
                return None
            tap.recording = False
            for p in tap.params:       # always_call=True: restored even on error
                p.requires_grad_(True)
            if not isinstance(output, torch.Tensor):
                return None
            call = len(tap.acts)
            tap.acts.append(inputs[0].detach())

            def keep_grad(grad, call=call):
                if call in tap.grads:
                    # A second backward through the same recorded forward (retain_graph):
                    # keeping either gradient alone would silently drop the other.
                    tap.grads[call] = None
                    return
                tap.grads[call] = grad
            return _CaptureGrad.apply(output, self._anchor, keep_grad)
        return hook

    def clear(self) -> None:
        """Forget recorded activations and gradients (e.g. after an aborted step)."""
        for tap in self.taps:
            tap.clear()

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    def _layer_specs(self):
        batch = None
        for tap in self.taps:
            if any(g is None for g in tap.grads.values()):
                raise RuntimeError(
                    f"GhostClipper: backward reached layer {tap.name!r} twice through the same "
                    "recorded forward; run exactly one loss.backward() per forward (sum the "
                    "losses first), or call clear() to discard the step")
            if len(tap.grads) != len(tap.acts):
                raise RuntimeError(
                    f"GhostClipper: layer {tap.name!r} ran forward {len(tap.acts)} time(s) but "
                    f"backward reached it {len(tap.grads)} time(s); run exactly one "
                    "loss.backward() per recorded forward (call clear() to discard a forward)")
            for a in tap.acts:
                if batch is None:
                    batch = a.shape[0]
                elif a.shape[0] != batch:
                    raise RuntimeError(f"GhostClipper: layer {tap.name!r} saw batch size "
                                       f"{a.shape[0]}, another layer {batch}")
        if batch is None:
            raise RuntimeError("GhostClipper: no forward/backward was recorded since the last step")
        specs = []
        for tap in self.taps:
            w = tap.module.weight
            d, K = w.shape[1], w.shape[0]
            if tap.acts:
                a = _cat_calls([_as_sequence(x, d) for x in tap.acts])
                g = _cat_calls([_as_sequence(tap.grads[i], K) for i in range(len(tap.acts))])
                if self.loss_reduction == "mean":
                    # Undo the batch mean so g holds each sample's own loss gradient.
                    g = g * batch
            else:  # unused this step: zero per-sample gradient, pure noise
                a = w.new_zeros((batch, 0, d))
                g = w.new_zeros((batch, 0, K))
            if a.dim() == 3 and a.shape[1] == 1:
                a, g = a[:, 0], g[:, 0]
            specs.append((a.to(w.dtype), g.to(w.dtype), tap.has_bias))
        return specs

    def privatize_(self) -> LayersClipResult:
        """Overwrite every trainable ``p.grad`` with its private gradient and forget
        the recorded tensors.  Returns the clip result (norms, clipped count,
        stream position)."""
        specs = self._layer_specs()
        result = clip_and_noise_layers(
            specs, max_norm=self.max_grad_norm, noise_multiplier=self.noise_multiplier,
            seed=self._stream, reduction=self.loss_reduction,
            expected_batch_size=self.expected_batch_size, nan_policy=self.nan_policy)
        for tap, (gw, gb) in zip(self.taps, result.grads):
            tap.module.weight.grad = gw
            if tap.has_bias:
                tap.module.bias.grad = gb
        self._steps += 1
        self.last_result = result
        self.clear()
        return result


class PoissonBatchSampler(_UsesStream):
    """True Poisson sampling for ``DataLoader(dataset, batch_sampler=...)``.

    Each of the ``steps`` batches includes every index 0..n-1 independently with
    probability ``sample_rate`` (:func:`ncdp_fast.poisson_batches`); empty
    batches are yielded as empty lists -- skipping them would change the
    privacy analysis -- so pair the loader with :func:`collate_with_empty`.
    Every pass over the sampler (every epoch) draws fresh batches from the next
    range of the stream; ``seed`` defaults to the OS.
    """

    def __init__(self, n: int, *, sample_rate: float, steps: int, seed=None,
                 offset: int | None = None):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps: expected an integer >= 0, got {steps!r}")
        self.n, self.sample_rate, self.batches = n, sample_rate, steps
        self._init_stream(seed, offset)
        poisson_batches(n, sample_rate=sample_rate, steps=0, seed=self._stream)  # validate

    @property
    def steps(self) -> int:
        """Batches per pass (the ``steps`` given)."""
        return self.batches

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        plan = poisson_batches(self.n, sample_rate=self.sample_rate, steps=self.batches,
                               seed=self._stream)
        self._steps += 1
        for batch in plan:
            yield batch.tolist()


def collate_with_empty(dataset, collate_fn=None):
    """A collate function that turns an empty batch into correctly shaped empty
    tensors (shape (0, *item_shape) for every field), the shapes and dtypes being
    read once from ``dataset[0]`` (shapes are public; no value is used)."""
    from torch.utils.data import default_collate
    collate = collate_fn or default_collate
    template = []

    def empty_like(item):
        if isinstance(item, (tuple, list)):
            return type(item)(empty_like(x) for x in item)
        if isinstance(item, dict):
            return {k: empty_like(v) for k, v in item.items()}
        t = torch.as_tensor(item)
        return t.new_empty((0, *t.shape))

    def fn(batch):
        if len(batch):
            return collate(batch)
        if not template:
            template.append(empty_like(dataset[0]))
        return template[0]
    return fn
