"""``PackedSequence`` input of :class:`~ncdp_fast.torch.DPLSTM` / ``DPGRU`` /
``DPRNN``.

torch packs the time steps so that step t holds only the sequences still
running, shorter ones falling off the end of the batch.  Our recurrences run
each step through ``nn.Linear`` cells, and the clipper requires every call of
a layer to have one row per sample (fewer rows are refused as a batch that is
not the samples).  So a packed batch is unpacked to a padded (B, T_max, F)
one in the caller's order, every step runs on all B rows, and a sequence
whose end has passed keeps its state through ``torch.where(mask_t, new,
old)``.  The discarded rows receive a gradient of exactly zero, so the padded
steps add exactly nothing to any sample's per-sample gradient or norm, and
the reverse direction of a sequence starts from the initial state at the
sequence's own last element (its earlier, padded steps leave the state as
it was).  The output is packed again with the input's ``batch_sizes``,
``sorted_indices`` and ``unsorted_indices``, as torch's modules return it.
"""
from __future__ import annotations

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

__all__ = ["unpack", "step_masks", "repack"]


def unpack(x: PackedSequence, name: str, input_size: int):
    """``(seq, lengths)``: ``seq`` (B, T_max, input_size), the sequences in the
    caller's order (the order before packing), zeros after each one's end;
    ``lengths`` (B,) int64 on ``seq``'s device."""
    data = x.data
    if data.dim() != 2 or data.shape[1] != input_size:
        raise ValueError(f"{name}: expected a PackedSequence of (sum of lengths, {input_size}) "
                         f"data, got data of shape {tuple(data.shape)}")
    seq, lengths = pad_packed_sequence(x, batch_first=True)
    return seq, lengths.to(seq.device)


def step_masks(lengths: torch.Tensor, T: int) -> list:
    """Per step t a (B, 1) bool mask, True where the sequence is still running."""
    running = torch.arange(T, device=lengths.device)[:, None] < lengths[None, :]   # (T, B)
    return list(running.unsqueeze(2).unbind(0))


def repack(output: torch.Tensor, like: PackedSequence, lengths: torch.Tensor) -> PackedSequence:
    """``output`` (B, T_max, F) in the caller's order, packed as ``like`` is:
    its data in ``like``'s sorted order, with ``like``'s batch sizes and
    indices (torch's modules return exactly those)."""
    if like.sorted_indices is not None:
        output = output.index_select(0, like.sorted_indices)
        lengths = lengths.index_select(0, like.sorted_indices)
    data = pack_padded_sequence(output, lengths.cpu(), batch_first=True,
                                enforce_sorted=True).data
    return PackedSequence(data, like.batch_sizes, like.sorted_indices, like.unsorted_indices)
