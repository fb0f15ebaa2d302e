"""The clipper's step: the checks before it (nothing written or drawn if one
fails), the clip-and-noise of the recorded batch and the write of the
private gradients (:meth:`privatize_`), or the noiseless clipped sum of a
physical batch kept for its logical batch (:meth:`accumulate_`).

:class:`PrivateStep` is a part of :class:`~ncdp_fast.torch.GhostClipper`
(its state is set up by the clipper's constructor).
"""
from __future__ import annotations

from .._clip import LayersClipResult
from .memory import add_clipped, across_ranks_error, check_same_parameters, fold_in
from .compiled import compiled_error
from .graphs import refuse_graph_capture
from .per_layer import clip_per_layer
from .precision import half_mean_error, overflow_error, overflowing, refuse_mixed_dtypes
from .ranks import refuse_with_ranks
from .taps import per_parameter, refuse_changed, step_entries
from .unprivatized import refuse_uncaptured

__all__ = ["PrivateStep"]


class PrivateStep:
    """:meth:`privatize_`, :meth:`accumulate_` and the checks they share."""

    def _per_layer(self, entries, blocks, grad_scale, noise=True):
        return clip_per_layer(self, entries, blocks, grad_scale, noise)

    def _hand_over(self, entries) -> tuple[list, list]:
        """(the step's blocks, its entries without them), the layers' records
        cleared: the clip op then holds the only references to the recorded
        tensors and frees each layer's once its sum is formed, so the step's
        peak is not every layer's activations and output gradients plus every
        private gradient."""
        blocks = [block for _, _, block in entries]
        entries = [(tap, names, None) for tap, names, _ in entries]
        self.clear()
        return blocks, entries

    def _step_entries(self, optimizer):
        """The checks before a step or an accumulation (nothing written or drawn
        if one fails): ``(entries, grad_scale)``.  Across ranks a rank's refusal
        is raised by every rank together: the refusing rank joins the step's
        first collective with it (ranks.refuse_with_ranks), instead of leaving
        the others waiting there (the sixth audit: a loss or penalty refused on
        one rank hung the other, or reached it as a raw gloo error)."""
        if self.group is None:
            return self._checked_entries(optimizer)
        try:
            return self._checked_entries(optimizer)
        except Exception as refusal:
            refuse_with_ranks(self.group, refusal)

    def _checked_entries(self, optimizer):
        if self._compiled:
            raise compiled_error()
        refuse_graph_capture("GhostClipper: the step")
        # On one process the loss's device checks ride with the clip op's own
        # read of its counts (one host wait a step, issue 36); across ranks the
        # reduction (ranks.reduce_clip_and_noise) takes none, so they are read here.
        self._deferred_checks = self._loss.settle(defer=self.group is None)
        if not any(p.requires_grad for t in self.taps for p in t.params.values()):
            raise RuntimeError(
                "GhostClipper: every parameter it privatizes has been frozen since it was "
                f"built ({self.param_names}); nothing would be trained. Unfreeze some, or "
                "skip the step")
        refuse_uncaptured(self.taps, self.param_names, self._uncaptured, self._uncaptured_grads)
        if self._half_grads and self.loss_reduction == "mean":
            raise half_mean_error(*next(iter(self._half_grads.items())))
        batch = self._batch.of_step(self.taps)
        if self._step_check is not None:
            self._step_check(batch)
        self._last_batch = batch
        refuse_changed(self._kept)
        self._refuse_outside_terms()
        entries = step_entries(self.taps, self._tied, batch,
                               self.group is None and self.gram_precision == "float32")
        refuse_mixed_dtypes(entries)
        self._refuse_foreign({id(tap.params[n]) for tap, names, _ in entries for n in names},
                             optimizer)
        check_same_parameters(self._accumulated, entries)
        # The output gradients of a batch-mean loss are each sample's own divided
        # by the batch size: the op multiplies back (on the (B,) norms and factors).
        scale = float(batch) if self.loss_reduction == "mean" and batch else 1.0
        return entries, scale

    def accumulate_(self, optimizer=None) -> None:
        """Clip this physical batch's samples and add their clipped sum to the
        logical batch's accumulator, without noise: the next :meth:`privatize_`
        adds it to its own batch's sum before noising once.  Same refusals as
        :meth:`privatize_` (nothing accumulated if one fails); no ``.grad`` is
        written, nothing drawn from the stream, no step counted.

        Privacy meaning: the physical batches of one logical (Poisson) batch
        hold disjoint samples, so each sample's whole gradient is clipped at
        ``max_grad_norm`` in exactly one of them and the logical step stays one
        Gaussian mechanism of sensitivity ``max_grad_norm``.  With a
        mean-reduced loss the physical batch's mean is undone by its realized
        size, and the step divides by ``expected_batch_size`` (the logical
        one) once."""
        if self.group is not None:
            # Refused on every rank together: a rank whose shard split into
            # more physical batches skips its step while the others step
            # (Opacus's BatchMemoryManager; the sixth audit saw them hang).
            refuse_with_ranks(self.group, across_ranks_error())
        entries, scale = self._step_entries(optimizer)
        blocks, entries = self._hand_over(entries)
        if self.clipping != "per_layer":
            only = self._clip_only(blocks, scale, release=True)
            grads = only.grads
            if self.adaptive is not None:
                self._centered += self.adaptive.centered_count(only)
        else:
            results, entries = self._per_layer(entries, blocks, scale, noise=False)
            grads = [r.grads[0] for r in results]
        add_clipped(self._accumulated, entries, grads)
        self.clear()

    def discard_accumulated(self) -> None:
        """Drop the clipped sums accumulated since the last :meth:`privatize_`
        (a logical batch left unfinished: nothing of it is released)."""
        self._accumulated.clear()
        self._centered = 0.0

    def privatize_(self, optimizer=None) -> LayersClipResult:
        """Overwrite every trainable ``p.grad`` with its private gradient and forget
        the recorded tensors.  Returns the clip result (per-sample norms over
        all layers, clipped count, stream position; with per-layer clipping
        ``num_clipped`` is the largest count of any parameter).

        Refuses (RuntimeError / ValueError, nothing written, no noise drawn) a
        gradient the step would not privatize: autograd's gradient of a
        privatized parameter from a use outside its layer, or any ``.grad`` on
        another parameter of the model (as it was at construction) or of
        ``optimizer`` (the torch optimizer about to step: pass it, so that a
        parameter it holds outside the model is checked too; ``DPOptimizer``
        does) other than one this clipper released.

        After :meth:`accumulate_` calls, the accumulated clipped sums are added
        before the noise's division (one noise for the logical batch);
        ``last_result`` then describes this call's physical batch only."""
        entries, scale = self._step_entries(optimizer)
        blocks, entries = self._hand_over(entries)
        if self.clipping != "per_layer":
            result = self._clip_and_noise(blocks, scale, release=True)
        else:
            result, entries = self._per_layer(entries, blocks, scale)
        writes = []
        accumulated = self._accumulated
        for tap, n, g in per_parameter(entries, result.grads):
            p = tap.params[n]
            if accumulated:
                g = fold_in(accumulated, tap.full(n), g, self.loss_reduction,
                            self.expected_batch_size)
            # A half parameter's gradient was summed and noised in float32:
            # rounded here, once.
            writes.append((tap, n, p, g if g.dtype == p.dtype else g.to(p.dtype)))
        # Spent with this step's noise, whether it is written or refused.
        self._accumulated.clear()
        centered, self._centered = self._centered, 0.0
        self._refuse_overflow(writes)
        if self.adaptive is not None:
            # After the step's noise, at the logical step: the next logical
            # batch is clipped (and noised) at the new bound throughout.  Drawn
            # before any gradient is written: the update reads the norms to the
            # host and can fail (a device error), and a gradient written by a
            # step that then raises would be released with the accountant (called
            # after this returns) never told.
            centered += self.adaptive.centered_count(result)
            bound = self.adaptive.next_bound(
                centered, self.max_grad_norm, self.expected_batch_size, self._stream)
        wrote = self._released.wrote
        for _, _, p, g in writes:
            p.grad = g
            wrote(p, g)
        self.clear()
        if self.adaptive is not None:
            self.max_grad_norm = bound
        return result

    def _refuse_overflow(self, writes) -> None:
        found = overflowing(writes)
        if found is not None:
            self.clear()
            raise overflow_error(*found, self._grad_noise_multiplier() * self.max_grad_norm)
