"""nn.MultiheadAttention, unmodified, under book-keeping clipping.

The module computes its projections with ``F.linear`` on its own weights, so no
hook on ``out_proj`` ever fires (Opacus ships its own attention module for this
reason).  The clipper instead gives each attention instance a forward that does
the same arithmetic step by step (projections, scaled dot-product attention,
output projection) and marks the two points whose inputs and output gradients
the rule needs; the state dict, the parameters and the outputs are the module's
own, and :meth:`GhostClipper.remove` restores the original forward.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .layer_rules import _cat, _flat_positions, factored_or_instantiated
from .layers import register_layer

__all__ = ["attention_forward", "check_attention"]


def check_attention(name: str, module: nn.MultiheadAttention) -> None:
    """Refuse what the step-by-step forward does not reproduce."""
    if module.bias_k is not None:
        raise ValueError(f"GhostClipper: attention {name!r} has add_bias_kv=True; not supported "
                         "(construct it with add_bias_kv=False)")
    if module.add_zero_attn:
        raise ValueError(f"GhostClipper: attention {name!r} has add_zero_attn=True; not supported")


def _additive_mask(mask, like):
    """A boolean mask (True = may not attend) or an additive float mask, as float."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(
            mask, float("-inf"))
    return mask.to(like.dtype)


def attention_forward(module: nn.MultiheadAttention, capture):
    """The forward installed on ``module``: ``capture(slot, input, output)`` records a
    projection's input and arranges for its output gradient; it returns the
    tensor to continue with."""
    E, H = module.embed_dim, module.num_heads
    hd = E // H

    def forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if query.dim() != 3:
            raise ValueError(f"attention: expected batched (3-D) query, got shape "
                             f"{tuple(query.shape)}; a per-sample gradient needs a batch")
        self_attention = query is key and key is value
        if not module.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        B, T, S = query.shape[0], query.shape[1], key.shape[1]
        b = module.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        if module._qkv_same_embed_dim and self_attention:
            qkv = capture("in", query, F.linear(query, module.in_proj_weight, b))
            q, k, v = qkv.chunk(3, dim=-1)
        elif module._qkv_same_embed_dim:
            wq, wk, wv = module.in_proj_weight.chunk(3)
            q = capture("q", query, F.linear(query, wq, bq))
            k = capture("k", key, F.linear(key, wk, bk))
            v = capture("v", value, F.linear(value, wv, bv))
        else:
            q = capture("q", query, F.linear(query, module.q_proj_weight, bq))
            k = capture("k", key, F.linear(key, module.k_proj_weight, bk))
            v = capture("v", value, F.linear(value, module.v_proj_weight, bv))
        q = q.reshape(B, T, H, hd).transpose(1, 2)
        k = k.reshape(B, S, H, hd).transpose(1, 2)
        v = v.reshape(B, S, H, hd).transpose(1, 2)
        mask = _additive_mask(attn_mask, q)
        if mask is not None:
            mask = mask.reshape(B, H, T, S) if mask.dim() == 3 else mask
        elif is_causal:
            mask = _additive_mask(torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1), q)
        kpm = _additive_mask(key_padding_mask, q)
        if kpm is not None:
            kpm = kpm.reshape(B, 1, 1, S)
            mask = kpm if mask is None else mask + kpm
        p = module.dropout if module.training else 0.0
        weights = None
        if need_weights:
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(hd)
            if mask is not None:
                scores = scores + mask
            weights = torch.softmax(scores, dim=-1)
            if p > 0:
                weights = F.dropout(weights, p=p)
            out = torch.matmul(weights, v)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        out = out.transpose(1, 2).reshape(B, T, E)
        o = module.out_proj
        y = capture("out", out, F.linear(out, o.weight, o.bias))
        if not module.batch_first:
            y = y.transpose(0, 1)
        return y, weights
    return forward


@register_layer(nn.MultiheadAttention)
def attention_rule(module: nn.MultiheadAttention, calls, trainable):
    """In-projection: with packed weights, every projected input (query, key,
    value: separate calls, or one call for self-attention) is a run of positions
    of one (3E, E) linear layer whose gradient is zero outside its third, so all
    of them form one pair (inputs concatenated along T, gradients padded to 3E).
    Separate q/k/v weights: one pair each, the packed bias from the three sums.
    Output projection: a pair."""
    E = module.embed_dim
    by = {}
    for c in calls:
        by.setdefault(c.slot, []).append(c)
    in_calls = [(c, third) for slot, third in (("in", None), ("q", 0), ("k", 1), ("v", 2))
                for c in by.get(slot, [])]
    padded = []                   # each call's gradient as one of the packed (3E) output
    for c, third in in_calls:
        g = _flat_positions(c.grad, c.grad.shape[-1])
        padded.append(g if third is None else F.pad(g, (third * E, (2 - third) * E)))
    out = []
    in_bias = "in_proj_bias" in trainable
    if "in_proj_weight" in trainable:
        a = _cat([_flat_positions(c.inputs[0], E) for c, _ in in_calls])
        names = ("in_proj_weight", "in_proj_bias") if in_bias else ("in_proj_weight",)
        out += factored_or_instantiated(a, _cat(padded), names, in_bias)
    else:
        for slot in "qkv":
            # One block per weight: the calls of a module run several times
            # in one forward are one longer sequence of that weight's positions.
            w = f"{slot}_proj_weight"
            parts = by.get(slot, [])
            if w in trainable and parts:
                a = _cat([_flat_positions(c.inputs[0], c.inputs[0].shape[-1]) for c in parts])
                g = _cat([_flat_positions(c.grad, E) for c in parts])
                out += factored_or_instantiated(a, g, (w,), False)
        if in_bias:
            out.append((("in_proj_bias",), _cat(padded).sum(1)))
    if "out_proj.weight" in trainable or "out_proj.bias" in trainable:
        parts = by.get("out", [])
        a = _cat([_flat_positions(c.inputs[0], E) for c in parts])
        g = _cat([_flat_positions(c.grad, E) for c in parts])
        if "out_proj.weight" in trainable:
            names = ("out_proj.weight", "out_proj.bias") if "out_proj.bias" in trainable \
                else ("out_proj.weight",)
            out += factored_or_instantiated(a, g, names, "out_proj.bias" in trainable)
        else:
            out.append((("out_proj.bias",), g.sum(1)))
    return out
