"""Per-layer clipping (``clipping="per_layer"``, as Opacus's per-layer
optimizer): each trainable parameter's per-sample gradient is clipped at its
own bound C_p, and each gets noise of std ``noise_multiplier * sqrt(sum C_p^2)``,
so the step is one Gaussian mechanism of sensitivity sqrt(sum C_p^2)."""
from __future__ import annotations

import math

import torch

from .._clip import LayersClipResult
from .._validate import check_positive
from .mechanism import keep_result

__all__ = ["layer_bounds", "check_fixed_bound", "clip_per_layer"]


def layer_bounds(max_grad_norm, clipping: str, param_names: list) -> list | None:
    """The bounds C_p, one per name of ``param_names`` (None unless per-layer):
    ``max_grad_norm`` a list of them, or a float C split as C / sqrt(P)."""
    if clipping != "per_layer":
        check_positive(max_grad_norm, "max_grad_norm")
        return None
    P = len(param_names)
    if isinstance(max_grad_norm, (list, tuple)):
        if len(max_grad_norm) != P:
            raise ValueError(f"max_grad_norm: expected {P} bounds for clipping='per_layer' "
                             f"(one per trainable parameter: {param_names}), got "
                             f"{len(max_grad_norm)}")
        return [check_positive(c, f"max_grad_norm[{i}]") for i, c in enumerate(max_grad_norm)]
    c = check_positive(max_grad_norm, "max_grad_norm")
    return [c / math.sqrt(P)] * P


def check_fixed_bound(clipping: str, bound: float, layer_norms, value) -> None:
    """Refuse a new ``max_grad_norm`` ``value`` (the total ``bound`` now) under
    per-layer clipping."""
    # Per-layer bounds are fixed: scaling them with a new total would be
    # one choice among many (Opacus's per-layer optimizer keeps clipping at
    # its old bounds while its noise follows the new total), so a change
    # is refused rather than guessed.
    if clipping == "per_layer" and check_positive(value, "max_grad_norm") != bound:
        raise ValueError(
            f"max_grad_norm: expected {bound!r} (fixed with "
            f"clipping='per_layer', bounds {layer_norms}), got {value!r}; a "
            "grad-clip scheduler needs clipping='flat', or build again (make_private) "
            "with the new per-layer bounds")


def _split(entries, blocks) -> tuple[list, list]:
    """One (tap, (name,), None) entry and one block per parameter (a pair
    block's bias split off), taking each block out of ``blocks``."""
    split, parts = [], []
    for i, (tap, names, _) in enumerate(entries):
        block, blocks[i] = blocks[i], None
        if isinstance(block, tuple) and len(names) == 2:
            a, g, _ = block
            split += [(tap, names[:1], None), (tap, names[1:], None)]
            parts += [(a, g, False), g.sum(1)]
        else:
            split.append((tap, names, None))
            parts.append(block)
    return split, parts


def clip_per_layer(clipper, entries, blocks, grad_scale, noise=True):
    """Each parameter of the step's ``entries`` [(tap, names, _)] on its own
    bound, one range of ``clipper``'s stream each, in order (``noise=False``:
    clipped sums only, no draw, no step counted).  ``blocks``, the entries'
    blocks, is consumed: the op gets the only references and frees each
    parameter's block once its sum is formed (on one process; across ranks
    the reduction holds them).  Returns ``(result, entries)`` with one entry
    per parameter; ``result`` is a list of the parameters' results when not
    ``noise``."""
    split, parts = _split(entries, blocks)
    bounds = dict(zip(clipper.param_names, clipper.layer_norms))
    mine = [bounds[t.full(n[0])] for t, n, _ in split]
    clip = clipper._clip_and_noise if noise else clipper._clip_only
    if clipper.group is None:
        # One op for every parameter (issue 36): one buffer, one host wait,
        # one claim of the step's range and one noise finish, where an op a
        # parameter had each of its own (about 0.3 ms of host time a
        # parameter on the 2-core VM); each parameter's factors, range and
        # sum are those of its own op.
        results = clip(parts, grad_scale, count=False, release=True, bounds=mine)
    else:
        # Across ranks each parameter's op is its own reduction.
        results = []
        for i, c in enumerate(mine):
            one, parts[i] = [parts[i]], None
            results.append(clip(one, grad_scale, count=False, max_norm=c, release=True))
    if not noise:
        return results, split
    clipper._steps += 1
    first = results[0]
    sq = sum(torch.as_tensor(r.norms, dtype=torch.float64) ** 2 for r in results)
    result = LayersClipResult(
        norms=sq.sqrt(), num_clipped=max(r.num_clipped for r in results),
        num_nonfinite=max(r.num_nonfinite for r in results), seed=first.seed,
        offset=first.offset, draws=sum(r.draws for r in results),
        grads=[r.grads[0] for r in results])
    clipper.last_result = keep_result(result)
    return result, split
