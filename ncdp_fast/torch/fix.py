"""Replace what private training cannot use: batch normalisation."""
from __future__ import annotations

import math

from torch import nn

__all__ = ["fix_batchnorm"]


def _group_norm(bn: nn.modules.batchnorm._BatchNorm) -> nn.GroupNorm:
    C = bn.num_features
    gn = nn.GroupNorm(math.gcd(32, C), C, eps=bn.eps, affine=bn.affine)
    return gn.to(device=bn.weight.device if bn.affine else None,
                 dtype=bn.weight.dtype if bn.affine else None)


def fix_batchnorm(model: nn.Module) -> nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` (and SyncBatchNorm) of ``model`` by a
    ``nn.GroupNorm`` with gcd(32, C) groups over the same C channels, in place;
    returns ``model`` (a batch norm at the top is returned replaced).

    Batch normalisation normalises each sample by statistics of the whole batch,
    so a sample's gradient depends on the others and per-sample clipping bounds
    nothing; group normalisation is per sample.  The new layers start from
    weight 1, bias 0 (the learned batch-norm affine is not carried over: it was
    fitted to other statistics), as Opacus's ``ModuleValidator.fix`` does.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        return _group_norm(model)
    for name, child in list(model.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            setattr(model, name, _group_norm(child))
        else:
            fix_batchnorm(child)
    return model
