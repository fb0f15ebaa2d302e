"""Replace what private training cannot use: batch normalisation, and torch's
fused recurrent layers."""
from __future__ import annotations

import math

from torch import nn

from .rnn import from_torch, replacement

__all__ = ["fix_batchnorm", "fix_recurrent"]


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


def fix_recurrent(model: nn.Module) -> nn.Module:
    """Replace every ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` of ``model`` by
    :class:`~ncdp_fast.torch.DPLSTM` / ``DPGRU`` / ``DPRNN`` with the same
    arguments and a copy of its weights (same function, same parameters,
    frozen ones kept frozen), in place; returns ``model`` (a recurrent layer at
    the top is returned replaced).  A ``proj_size`` LSTM is refused."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if replacement(model):
        return from_torch(model)
    for name, child in list(model.named_children()):
        if replacement(child):
            setattr(model, name, from_torch(child))
        else:
            fix_recurrent(child)
    return model
