"""Gradients a clipper step would not privatize, refused before anything is
written: a term outside a layer's forward, the ordinary gradient of a forward
the clipper did not record (eval mode, hooks disabled), and a ``.grad`` on a
parameter the step does not cover.  Each would reach the optimizer raw,
unclipped and unnoised, while the step is accounted as private."""
from __future__ import annotations

from .mechanism import foreign_grad_error

__all__ = ["refuse_outside_terms", "refuse_uncaptured", "foreign_error"]


def refuse_outside_terms(outside: dict, param_names: list) -> None:
    """``outside``: {parameter name: layer type} of the privatized parameters
    autograd gave a gradient from outside their layer's forward."""
    if outside:
        # In the model's order (the hooks fired in backward's order).
        shown = ", ".join(f"{n!r} ({outside[n]})" for n in param_names
                          if n in outside)
        raise RuntimeError(
            f"GhostClipper: parameter(s) {shown} got a gradient from outside the layer's "
            "forward in this backward: a term that uses the parameter directly "
            "(a tied weight such as F.linear(h, emb.weight), a penalty on the weights "
            "in the loss, a subclass forward that uses the weight itself). Its private "
            "gradient comes from the layer's inputs and output gradients only, so that "
            "term would be dropped. Put weight decay in the optimizer (weight_decay=), "
            "tie weights by calling the layer itself, or register a rule for a layer "
            "that computes the whole use; call clear() to discard this step")


def refuse_uncaptured(taps, param_names: list, causes: set, grads: dict) -> None:
    """``grads``: the privatized parameters a backward gave a gradient after a
    forward that was not recorded for one of ``causes`` ("eval", "disabled");
    refused if any still holds one."""
    if not grads:
        return
    params = {t.full(n): p for t in taps
              for n, p in t.owned.items()}
    # A gradient discarded since (zero_grad, to None or to zeros) is gone:
    # only one still held counts.  An all-zero .grad adds nothing to the step
    # whatever wrote it (a read of the device, on this rare path only).
    held = [n for n in param_names
            if n in grads and params[n].grad is not None and bool(params[n].grad.any())]
    if not held:
        return
    shown = []
    if "eval" in causes:
        shown.append("ran in eval mode (the model's training flag was False: model.eval())")
    if "disabled" in causes:
        shown.append("ran while the hooks were disabled (disable_hooks())")
    raise RuntimeError(
        f"GhostClipper: parameter(s) {held} hold a gradient that was not privatized: a "
        f"forward since the last step {' and one '.join(shown)}, when the clipper records "
        "nothing (as Opacus), and a backward gave them its ordinary, unclipped and "
        "unnoised gradient (or a term outside the layer's forward, such as a tied weight, "
        "did). Evaluate under torch.no_grad(); call model.train() (and enable_hooks()) "
        "before a training forward; discard these gradients with zero_grad() and "
        "clipper.clear(). Nothing was written")


def foreign_error(model, taps, p, where) -> ValueError:
    """The refusal of ``p``'s gradient, found at ``where`` (None for a model
    parameter, else its (group, index) in the optimizer), that the step does
    not privatize."""
    names = {id(q): n for n, q in model.named_parameters()}
    if id(p) in names:
        name = repr(names[id(p)])
        mine = {id(q) for t in taps for q in t.params.values()}
        reason = ("it was frozen when this step's forward ran" if id(p) in mine else
                  "it is not one of the clipper's parameters: it was frozen when the "
                  "clipper was built (make_private) and unfrozen since, or added since")
    else:
        name = f"optimizer.param_groups[{where[0]}]['params'][{where[1]}]"
        reason = ("it is not a parameter of the model the clipper wraps: an extra "
                  "parameter given to the optimizer, or an add_param_group")
    return foreign_grad_error(
        "GhostClipper", name, p, reason,
        "Build the clipper (make_private) once the model and optimizer hold every "
        "parameter to train, unfrozen; to leave one untrained, freeze it "
        "(requires_grad_(False)) and set its .grad to None")
