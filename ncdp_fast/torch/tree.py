"""The model as the clipper checked it, checked again before every recorded
forward (issue 35, items 5 and 6): the module tree, the options the refusals
read, and the code each layer's rule was chosen for.

A module swapped in after the clipper was built (a batch norm, whose running
statistics would keep the private batches' means unnoised), an option set on a
layer (``Embedding.max_norm``, which renormalises the batch's rows in place
during the forward) or a layer whose ``forward`` was replaced would otherwise
run unchecked: the refusals ran once, at construction. Refused here, in the
model's forward pre-hook, before any module runs and before anything private
is written.
"""
from __future__ import annotations

from operator import attrgetter, is_not

from torch import nn

from .coupling import may_mix_the_batch, refuse_batch_mixing
from .layers import option_check, refuse_options

__all__ = ["ModelSnapshot"]


_children = attrgetter("_modules")


def _walk(model: nn.Module) -> list:
    """(name, module) of every module, duplicates included."""
    return list(model.named_modules(remove_duplicate=False))


def _tree(walked) -> tuple:
    return tuple((name, id(m), type(m)) for name, m in walked)


def _forward_of(module: nn.Module):
    """The forward the module runs: an instance attribute, else its class's."""
    own = module.__dict__.get("forward")
    return own if own is not None else type(module).forward


class ModelSnapshot:
    """What the clipper checked: the module tree (names, identities, classes)
    and each layer's forward; :meth:`check` refuses any difference and re-runs
    the refusals that read options (which are mutable)."""

    def __init__(self, model: nn.Module, taps, patched):
        walked = _walk(model)
        self.tree = _tree(walked)
        # Every module with its class and its children's names and
        # identities: the tree changes only through some module's _modules
        # (an assignment, add_ or register_module, a deletion) or a module's
        # class, so comparing these finds any change without a walk, a
        # generator frame a module every forward (EfficientNet-Lite0: some
        # 1 900 Python calls a step, issue 36's host time); the walk and its
        # message follow a mismatch.  Identities, not ==: a module class may
        # define __eq__ (a dataclass module's compares fields).  Every child
        # is itself a node, held here, so no identity is reused.
        unique = {id(m): m for _, m in walked}.values()
        # Leaves (most modules) apart: a leaf is unchanged while its class is
        # and it has no children, tested over all leaves at once in C (map over
        # builtins: no Python frame or bytecode a module).
        self.leaves = [m for m in unique if not m._modules]
        self.leaf_classes = [type(m) for m in self.leaves]
        self.nodes = [(m, type(m), tuple(m._modules), tuple(map(id, m._modules.values())))
                      for m in unique if m._modules]
        # The modules whose options the batch-mixing refusal reads: with the
        # tree unchanged (names, identities, classes), no other module can be
        # refused, so each forward re-runs it on these alone.
        self.mixing = [(name, m) for name, m in walked if may_mix_the_batch(m)]
        # (module id, attribute) of the clipper's own instance patches.
        self.patched = patched
        self.forwards = {id(t.module): _forward_of(t.module) for t in taps}
        # Each layer's option check as its rule's class registered it, and
        # whether it is an embedding (whose options refuse_options reads): while
        # the tree is unchanged the classes are, so neither the rule's look-up
        # (an MRO walk, a qualified name) nor a call for a layer with no
        # options to read is repeated each forward (issue 36's host time).
        self.option_checks = {}
        for t in taps:
            check = option_check(t.module)
            if check is not None or isinstance(t.module, nn.Embedding):
                self.option_checks[id(t.module)] = check

    def check(self, model: nn.Module, taps) -> None:
        leaves = self.leaves
        if any(map(is_not, map(type, leaves), self.leaf_classes)) or \
                any(map(_children, leaves)):
            self._refuse_changed(model)
        for m, cls, names, ids in self.nodes:       # a loop: no frame a module
            if (m.__class__ is not cls or tuple(m._modules) != names
                    or tuple(map(id, m._modules.values())) != ids):
                self._refuse_changed(model)
                break
        for name, module in self.mixing:
            refuse_batch_mixing(name, module)
        self._check_taps(taps)

    def _refuse_changed(self, model: nn.Module) -> None:
        """Refuse a module tree that differs from the one checked, naming what
        was added and removed."""
        tree = _tree(_walk(model))
        if tree != self.tree:
            before = {(n, i) for n, i, _ in self.tree}
            now = {(n, i) for n, i, _ in tree}
            kinds = {(n, i): t.__name__ for n, i, t in self.tree + tree}
            added = sorted(f"{n or '<model>'} ({kinds[n, i]})" for n, i in now - before)
            removed = sorted(f"{n or '<model>'} ({kinds[n, i]})" for n, i in before - now)
            raise ValueError(
                "GhostClipper: the model's modules changed after the clipper was built "
                f"(added: {added or 'none'}; removed: {removed or 'none'}); it checked only "
                "those it was built with, so this forward is refused before any module runs. "
                "Change the model first, then build the clipper (make_private)")

    def _check_taps(self, taps) -> None:
        checks, forwards = self.option_checks, self.forwards
        for tap in taps:
            module = tap.module
            if id(module) in checks:
                refuse_options(tap.name, module, checks[id(module)])
            if _forward_of(module) is not forwards[id(module)]:
                raise ValueError(
                    f"GhostClipper: layer {tap.name!r} ({type(module).__name__}) runs another "
                    "forward than the one its rule was chosen for (its forward was replaced "
                    "after the clipper was built); the rule's gradient would not be this "
                    "forward's. Build the clipper after changing the layer")
            if module.__dict__.get("forward") is not None and \
                    (id(module), "forward") not in self.patched:
                raise ValueError(
                    f"GhostClipper: layer {tap.name!r} ({type(module).__name__}) has an "
                    "instance-level forward: the rule computes the class's per-sample gradient, "
                    "not this function's. Register a rule for a subclass instead "
                    "(ncdp_fast.torch.register_layer)")
