"""The network ``ncdp-fast reproduce dp-finetune`` trains (and bench_finetune
times): the package's ImageNet-pretrained EfficientNet-Lite0 made trainable by
per-sample clipping, its batch norms folded or replaced and its TensorFlow-SAME
convolutions as plain ``nn.Conv2d``."""
from __future__ import annotations

import math


def finetune_model(num_classes: int = 10, resolution: int = 96, pretrained: bool = True,
                   blocks: int | None = None, batchnorm: str = "groupnorm"):
    """EfficientNet-Lite0 ready for private full fine-tuning on ``resolution``-sided
    inputs: the ImageNet-pretrained network of :mod:`ncdp_fast.datasets` with

    * its batch norms, which mix the samples of a batch in training, either
      replaced by group norms (``batchnorm="groupnorm"``:
      :func:`ncdp_fast.torch.fix_batchnorm`, as Opacus's ``ModuleValidator.fix``;
      the pretrained normalisation and its affine are lost) or folded, with their
      ImageNet running statistics, into the preceding convolution, which gains a
      trainable bias (``batchnorm="fold"``:
      :func:`ncdp_fast.datasets._efficientnet.fold_batchnorm`; the network starts
      as exactly the pretrained feature extractor, and every sample is still
      processed on its own);
    * its ``SameConv2d`` convolutions (TensorFlow "SAME" padding) as plain
      ``nn.Conv2d``: stride 1 with the symmetric padding k // 2 (what SAME is
      there), stride 2 as an ``nn.ZeroPad2d`` of the SAME padding at this
      resolution before an unpadded ``nn.Conv2d`` (same weights, same outputs).
      ``SameConv2d`` pads with ``F.pad`` inside its forward, and hook-based
      per-sample clipping (GhostClipper, Opacus) reads a convolution's input as
      the module receives it, before that padding; Opacus also looks its
      per-sample rules up by exact type;
    * a new ``num_classes``-way head ``_fc`` (zero-initialised);

    in train mode, every parameter trainable.  ``blocks``: keep only the first
    ``blocks`` of the 16 MBConv blocks, with a fresh 1x1 head convolution (for
    smoke tests and the smallest benchmark size: the same layer types, a
    fraction of the cost; not the pretrained network)."""
    import torch
    from torch import nn

    from ..datasets._efficientnet import HEAD, efficientnet_lite0, fold_batchnorm
    from ..torch import fix_batchnorm
    if batchnorm not in ("groupnorm", "fold"):
        raise ValueError(f"batchnorm: expected 'groupnorm' or 'fold', got {batchnorm!r}")
    model = efficientnet_lite0(pretrained=pretrained)
    if batchnorm == "fold":
        model = fold_batchnorm(model)
    model = plain_convs(model, resolution)
    if blocks is not None:
        model._blocks = model._blocks[:blocks]
        cout = model._blocks[-1]._project_conv.out_channels if blocks else model._bn0.num_features
        model._conv_head = nn.Conv2d(cout, HEAD, 1, bias=batchnorm == "fold")
    fix_batchnorm(model)
    model._fc = nn.Linear(HEAD, num_classes)
    with torch.no_grad():
        model._fc.weight.zero_()
        model._fc.bias.zero_()
    for q in model.parameters():
        q.requires_grad_(True)
    return model.train()


def plain_convs(model, resolution: int):
    """``model`` (EfficientNet-Lite0 of :mod:`ncdp_fast.datasets`) with every
    ``SameConv2d`` replaced in place by plain torch modules computing the same
    outputs on ``resolution``-sided inputs (see :func:`finetune_model`)."""
    import torch
    from torch import nn
    convs = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    seen = {}
    hooks = [m.register_forward_pre_hook(
                 lambda mod, inp, name=name: seen.__setitem__(name, tuple(inp[0].shape[-2:])))
             for name, m in convs]
    try:
        with torch.no_grad():
            model.features(torch.zeros(1, 3, resolution, resolution))
    finally:
        for h in hooks:
            h.remove()
    for name, old in convs:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        (k, _), (s, _) = old.kernel_size, old.stride
        conv = nn.Conv2d(old.in_channels, old.out_channels, old.kernel_size, stride=old.stride,
                         groups=old.groups, bias=old.bias is not None,
                         padding=k // 2 if s == 1 else 0)
        conv.weight = old.weight
        if old.bias is not None:
            conv.bias = old.bias
        if s == 1:          # SAME padding at stride 1 is the symmetric k // 2
            setattr(owner, attr, conv)
            continue
        ih, iw = seen[name]
        ph = max((math.ceil(ih / s) - 1) * s + k - ih, 0)
        pw = max((math.ceil(iw / s) - 1) * s + k - iw, 0)
        setattr(owner, attr, nn.Sequential(
            nn.ZeroPad2d((pw // 2, pw - pw // 2, ph // 2, ph - ph // 2)), conv))
    return model
