"""nn.MultiheadAttention, unmodified, under book-keeping clipping.

The module computes its projections with ``F.linear`` on its own weights, so no
hook on ``out_proj`` ever fires (Opacus ships its own attention module for this
reason).  The clipper instead gives each attention instance a forward that does
the same arithmetic step by step (projections, scaled dot-product attention,
output projection, with ``add_bias_kv``'s learned key and value and
``add_zero_attn``'s zero ones appended as torch's function appends them) and
marks the points whose inputs and output gradients the rule needs; the state dict, the parameters and the outputs are the module's
own, and :meth:`GhostClipper.remove` restores the original forward.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .layer_rules import _cat, _flat_positions, factored_or_instantiated
from .layers import register_layer, register_layer_by_name

__all__ = ["attention_forward"]


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
        if module.bias_k is not None:
            # add_bias_kv: one learned key and value after each sample's S, as
            # rows of their own (B, 1, E), so that each sample's gradient of
            # the two biases is its own row's (the rule's dense blocks).  A
            # view of the parameter is no sample input: the capture reads the
            # samples' layout from the query.
            bk = capture("bias_k", query, module.bias_k.reshape(1, 1, E).expand(B, 1, E))
            bv = capture("bias_v", query, module.bias_v.reshape(1, 1, E).expand(B, 1, E))
            k, v = torch.cat([k, bk], dim=1), torch.cat([v, bv], dim=1)
        q = q.reshape(B, T, H, hd).transpose(1, 2)
        k = k.reshape(B, k.shape[1], H, hd).transpose(1, 2)
        v = v.reshape(B, v.shape[1], H, hd).transpose(1, 2)
        if module.add_zero_attn:
            zeros = k.new_zeros((B, H, 1, hd))
            k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
        keys = k.shape[2]               # S and the keys the options appended
        if is_causal and (attn_mask is None or (key_padding_mask is None and not need_weights)):
            # torch's function hands the hint to SDPA in place of the mask
            # where neither padding nor weights need the mask (is_causal over
            # every key, the appended ones included); without a mask its
            # module refuses, and this forward forms the same causal mask.
            mask = _additive_mask(
                torch.ones(T, keys, dtype=torch.bool, device=q.device).triu(1), q)
        else:
            # As torch's function pads them: a zero column (may attend) for
            # each appended key.
            mask = _additive_mask(attn_mask, q)
            if mask is not None:
                mask = mask.reshape(B, H, T, S) if mask.dim() == 3 else mask
                mask = F.pad(mask, (0, keys - S)) if keys > S else mask
        kpm = _additive_mask(key_padding_mask, q)
        if kpm is not None:
            kpm = kpm.reshape(B, 1, 1, S)
            kpm = F.pad(kpm, (0, keys - S)) if keys > S else kpm
        if kpm is not None:
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
    Output projection: a pair.  ``bias_k`` and ``bias_v`` (add_bias_kv): dense
    (B, 1, 1, E) blocks, each sample's gradient of its appended key or value
    row."""
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
    for name in ("bias_k", "bias_v"):
        # Each call's appended row (B, 1, E): the sample's gradient of the
        # (1, 1, E) bias, summed over the calls of the step.
        parts = by.get(name, [])
        if name in trainable and parts:
            g = parts[0].grad
            for c in parts[1:]:
                g = g + c.grad
            out.append(((name,), g.reshape(g.shape[0], 1, 1, E)))
    return out


@register_layer_by_name("opacus.layers.dp_multihead_attention.SequenceBias")
def sequence_bias_rule(module, calls, trainable):
    """Opacus's SequenceBias (its DPMultiheadAttention with add_bias_kv=True)
    appends its (E,) bias after each sample's sequence: the sample's gradient
    is that last position's, summed over the calls of the step (dense (B, E))."""
    g = calls[0].grad[:, -1]
    for c in calls[1:]:
        g = g + c.grad[:, -1]
    return [(("bias",), g)]
