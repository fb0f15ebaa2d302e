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

from itertools import chain, repeat
from operator import attrgetter, is_not

from torch import nn
from torch.nn.modules import module as _module

from .coupling import may_mix_the_batch, refuse_batch_mixing
from .layers import option_check, refuse_options

__all__ = ["ModelSnapshot"]


_children = attrgetter("_modules")
_parameters = attrgetter("_parameters")
_forward_hooks = attrgetter("_forward_hooks")
_backward_hooks = attrgetter("_backward_hooks")
_backward_pre_hooks = attrgetter("_backward_pre_hooks")


def _parameter_ids(modules) -> list:
    """The identities of every module's parameters (a None slot's too), in
    order, in C (maps over builtins: no Python frame a module)."""
    return list(map(id, chain.from_iterable(map(dict.values, map(_parameters, modules)))))


def _first_hooks(modules) -> list:
    """The id of each module's first forward hook (a module with none ends the
    list early: StopIteration ends a map)."""
    return list(map(next, map(iter, map(_forward_hooks, modules))))


def _walk(model: nn.Module) -> list:
    """(name, module) of every module, duplicates included."""
    return list(model.named_modules(remove_duplicate=False))


def _tree(walked) -> tuple:
    return tuple((name, id(m), type(m)) for name, m in walked)


_module_of_tap = attrgetter("module")


def _own_forwards(modules) -> list:
    """Each module's instance-level forward, None where it has none (in C)."""
    return list(map(dict.get, map(vars, modules), repeat("forward")))


def _class_forwards(modules) -> list:
    """Each module's class's forward (in C)."""
    return list(map(getattr, map(type, modules), repeat("forward")))


def _forward_of(module: nn.Module):
    """The forward the module runs: an instance attribute, else its class's."""
    own = module.__dict__.get("forward")
    return own if own is not None else type(module).forward


class ModelSnapshot:
    """What the clipper checked: the module tree (names, identities, classes)
    and each layer's forward; :meth:`check` refuses any difference and re-runs
    the refusals that read options (which are mutable)."""

    def __init__(self, model: nn.Module, taps, patched, captures=()):
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
        # Every module's parameters, by identity: a Parameter assigned after
        # construction (``layer.weight = nn.Parameter(...)``, or one registered
        # on a module that had none) is not one the clipper privatizes, and
        # its ordinary gradient would be applied raw.  The objects are held,
        # so no identity is reused.
        self.modules = list(unique)
        self.params = list(chain.from_iterable(map(dict.values, map(_parameters,
                                                                    self.modules))))
        self.param_ids = list(map(id, self.params))
        # Each layer's layout was set from batch_first where a module has one
        # (layout.set_layouts): flipped later, a sequence-first call would be
        # read batch-first (silently where B == T).
        names = {}
        for name, m in walked:
            names.setdefault(id(m), name)
        self.batch_firsts = [(names[id(m)], m, m.batch_first) for m in unique
                             if isinstance(getattr(m, "batch_first", None), bool)]
        # (module, hook id) of the layers whose output a forward hook captures:
        # the capture must be the first hook to see the output (one run
        # before it may return a changed output, whose gradient is not the
        # layer's), and no global module forward hook may run (those run
        # before every module's own).
        self.capture_modules = [m for m, _ in captures]
        self.capture_ids = [i for _, i in captures]
        self.capture_names = {id(t.module): t.name for t in taps}
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
            if check is not None or isinstance(t.module, (nn.Embedding, nn.EmbeddingBag)):
                self.option_checks[id(t.module)] = check
        # The layers' forwards as they were, for the check's first pass over
        # all of them at once in C (maps over builtins): each layer's own
        # (instance) forward, None where it has none, and its class's.
        self.tap_modules = [t.module for t in taps]
        self.tap_own_forwards = _own_forwards(self.tap_modules)
        self.tap_class_forwards = _class_forwards(self.tap_modules)
        self.option_taps = [k for k, t in enumerate(taps) if id(t.module) in self.option_checks]

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
        if _parameter_ids(self.modules) != self.param_ids:
            self._refuse_parameters(model)
        for name, m, batch_first in self.batch_firsts:
            if m.batch_first is not batch_first:
                raise ValueError(
                    f"GhostClipper: module {name or '<model>'!r} ({type(m).__name__}) "
                    f"batch_first was {batch_first} when the clipper was built, is "
                    f"{m.batch_first} now: each layer's batch dimension was set from it, so "
                    "this forward is refused before any module runs. Set batch_first before "
                    "building the clipper (make_private)")
        if self.capture_modules and (_module._global_forward_hooks or
                                     _first_hooks(self.capture_modules) != self.capture_ids):
            self._refuse_hooks()
        if any(map(bool, map(_backward_hooks, self.modules))) or \
                any(map(bool, map(_backward_pre_hooks, self.modules))) or \
                _module._global_backward_hooks or _module._global_backward_pre_hooks:
            self._refuse_backward_hooks(model)
        self._check_taps(taps)

    def _refuse_parameters(self, model: nn.Module) -> None:
        before = {id(p) for p in self.params if p is not None}
        changed = sorted(name or "<model>" for name, p in model.named_parameters(
            remove_duplicate=False) if id(p) not in before)
        raise ValueError(
            "GhostClipper: the model's parameters changed after the clipper was built "
            f"(new or replaced: {changed or 'none'}; or one was removed): the clipper "
            "privatizes the parameters it was built with, and a new one's ordinary gradient "
            "would be applied raw, so this forward is refused before any module runs. Change "
            "the parameters first, then build the clipper (make_private), or copy new values "
            "into the existing ones (load_state_dict, p.data.copy_)")

    def _refuse_backward_hooks(self, model: nn.Module) -> None:
        hooked = sorted(name or "<model>" for name, m in model.named_modules()
                        if m._backward_hooks or m._backward_pre_hooks)
        raise ValueError(
            "GhostClipper: a module backward hook is registered "
            f"({hooked or 'a global one: register_module_full_backward_hook'}): it may change "
            "the gradients flowing to the layers (mixing the samples, as a normalisation of "
            "grad_output over the batch would) where the loss check cannot read it, so this "
            "forward is refused before any module runs. Remove it during private training; "
            "a tensor hook (Tensor.register_hook) that only reads is not affected")

    def _refuse_hooks(self) -> None:
        if _module._global_forward_hooks:
            raise ValueError(
                "GhostClipper: a global module forward hook is registered "
                "(torch.nn.modules.module.register_module_forward_hook, as module trackers "
                "and FLOP counters do): it runs before each layer's own hooks and may change "
                "a layer's output before the clipper captures it, whose gradient would then "
                "not be the layer's, so this forward is refused before any module runs. "
                "Remove it during private training")
        firsts = _first_hooks(self.capture_modules)
        for k, m in enumerate(self.capture_modules):
            if k >= len(firsts) or firsts[k] != self.capture_ids[k]:
                raise ValueError(
                    f"GhostClipper: layer {self.capture_names[id(m)]!r} ({type(m).__name__}) "
                    "has a forward hook that runs before the clipper's capture (registered "
                    "with prepend=True after the clipper was built, or the capture removed): "
                    "it may change the layer's output, whose gradient would then not be the "
                    "layer's, so this forward is refused before any module runs. Register "
                    "the hook without prepend (it then runs after the capture, which is exact)")

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
        mods = self.tap_modules
        own = _own_forwards(mods)
        if (len(taps) == len(mods) and not any(map(is_not, map(_module_of_tap, taps), mods))
                and own.count(None) == len(own)
                and not any(map(is_not, own, self.tap_own_forwards))
                and not any(map(is_not, _class_forwards(mods), self.tap_class_forwards))):
            # The layers built with, no instance-level forward (what the loop
            # below refuses unless the clipper's own), and every class's forward
            # the one its rule was chosen for: only the option checks remain
            # (BERT's 102 layers: 48 -> 32 us, fastest of 7, on the 2-core VM,
            # issue 36's host time).
            checks = self.option_checks
            for k in self.option_taps:
                tap = taps[k]
                refuse_options(tap.name, tap.module, checks[id(tap.module)])
            return
        self._check_each_tap(taps)

    def _check_each_tap(self, taps) -> None:
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
