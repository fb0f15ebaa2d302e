"""Where the device waits for the host inside one profiled step, by phase of
the step (bench/profile_step.py's ``profile_idle`` report).

The H200 run of 2026-12-01 (commit 12eb27d) measured the private GPT-2 step
53 ms against 45 ms non-private while its kernels added 3.8 ms
(profile_extra): about 4 ms of the step is the device waiting for the host,
and a profile summed by kernel cannot say where.  Here the profiled step's
host phases (marked by :func:`markers`) are laid over the device's busy
intervals: the device time a phase leaves idle is time the host, not the
device, set the pace, so a change to that phase's host work is what moves it.

Phases, on the thread that called the step: ``forward`` (the step's start to
autograd's first node: zero_grad, the forward, the loss), ``backward``
(autograd's first node to its last), ``to optimizer`` (to the optimizer's
step), ``before transfer`` (the optimizer's step to the clip op's one host
transfer: the norms and factors queued), ``transfer`` (the copy the host
waits for), ``after transfer`` (the rest of the optimizer's step: the clipped
sums and the noise queued; the whole optimizer step where there is no
transfer), ``after optimizer`` (to the step's end) and ``drain`` (the step
returned, the device still busy: no idle time by definition, its length is
reported).
Under the profiler each host operator costs more than without it, so the
idle times are upper bounds of the unprofiled step's.
"""
from __future__ import annotations

import bisect
import contextlib

STEP, TRANSFER = "phase: step", "phase: transfer"
# autograd's range around each node it runs (on its device thread on a GPU).
BACKWARD_PREFIX = "autograd::engine::evaluate_function"
OPTIMIZER_PREFIX = "Optimizer.step#"
PHASES = ("forward", "backward", "to optimizer", "before transfer", "transfer",
          "after transfer", "after optimizer")
# Gaps shorter than this are a kernel's launch latency, not the host falling behind.
GAP_US = 20.0
TOP_GAPS = 5


@contextlib.contextmanager
def markers(torch):
    """Mark the clip op's host transfer with a ``record_function`` range while
    the block runs.  The optimizer's step is marked by torch itself and the
    backward is read from autograd's own ranges: a patched Tensor.backward
    would hide the call from the loss check's torch-function mode, which
    refuses the step (as it should)."""
    import ncdp_fast._clip_layers as clip_layers
    accounting = clip_layers._accounting

    def marked_accounting(*args, **kwargs):
        with torch.profiler.record_function(TRANSFER):
            return accounting(*args, **kwargs)
    clip_layers._accounting = marked_accounting
    try:
        yield
    finally:
        clip_layers._accounting = accounting


def merge(intervals) -> list:
    """Sorted, disjoint (start, end) covering the given ones (kernels of several
    streams overlap)."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def covered(busy, a, b) -> float:
    """Length of [a, b) that the merged intervals ``busy`` cover."""
    if b <= a:
        return 0.0
    i = max(bisect.bisect_right(busy, (a, float("inf"))) - 1, 0)
    total = 0.0
    for s, e in busy[i:]:
        if s >= b:
            break
        total += max(0.0, min(e, b) - max(s, a))
    return total


def phase_bounds(step, backward, optimizer, transfer) -> list:
    """(phase, start, end) of the step's host phases, µs; ``backward``,
    ``optimizer`` and ``transfer`` are (start, end) or None (a step without
    one: its phases have length 0 at the point where it would be)."""
    s0, s1 = step
    b0, b1 = backward or (s1, s1)
    o0, o1 = optimizer or (b1, b1)
    t0, t1 = transfer or (o0, o0)
    cuts = [s0, b0, b1, o0, t0, t1, o1, s1]
    for i in range(1, len(cuts)):          # markers out of order: clamp, never negative
        cuts[i] = min(max(cuts[i], cuts[i - 1]), s1)
    return [(name, cuts[i], cuts[i + 1]) for i, name in enumerate(PHASES)]


def device_events(events, device_type) -> list:
    """The device's kernels and copies of ``prof.events()``: not the
    device-side ranges of user annotations (an optimizer's step, which the
    2026-12-01 run counted as busy time, busy > wall)."""
    return [e for e in events
            if e.device_type == device_type and not getattr(e, "is_user_annotation", False)]


def idle_by_phase(phases, busy) -> dict:
    """Per phase the host's ms and the device's idle ms in it, the drain (the
    device busy after the step returned) and the device's busy ms in the
    window; ``busy``: the kernels' (start, end) µs, :func:`merge`d."""
    out = {}
    for name, a, b in phases:
        out[name] = dict(host_ms=(b - a) / 1e3, idle_ms=(b - a - covered(busy, a, b)) / 1e3)
    end = phases[-1][2]
    last = max((e for _, e in busy), default=end)
    out["drain"] = dict(device_ms=max(0.0, last - end) / 1e3)
    out["busy_ms"] = sum(e - s for s, e in busy) / 1e3
    return out


def gaps(phases, busy, min_us=GAP_US) -> list:
    """The device's idle gaps of at least ``min_us`` inside the step's host
    span (``busy`` :func:`merge`d): (start, length µs, phase), longest first.
    The span's start counts as the end of a busy interval (the device idles
    until the first kernel)."""
    a, b = phases[0][1], phases[-1][2]
    found, t = [], a
    for s, e in busy:
        if e <= a:
            continue
        if s >= b:
            break
        if s - t >= min_us:
            found.append((t, s - t))
        t = max(t, e)
    if b - t >= min_us:
        found.append((t, b - t))
    out = []
    for start, length in found:
        phase = next((n for n, p0, p1 in phases if p0 <= start < p1), phases[-1][0])
        out.append((start, length, phase))
    out.sort(key=lambda g: -g[1])
    return out


def innermost(host_events, t):
    """The name of the innermost host range covering time ``t`` (µs): at a
    gap's middle, what the host was running while the device sat idle."""
    best = None
    for name, s, e in host_events:
        if s <= t < e and (best is None or e - s < best[2] - best[1]):
            best = (name, s, e)
    return None if best is None else best[0]


def analyse(events, device_type) -> dict | None:
    """The phases of the profiled step in ``events`` (``prof.events()``), the
    device's idle time in each and its longest gaps (on the CPU, no device
    events: the phases' host ms only, idle None), or None where the profile
    has no marked step."""
    step = next((e for e in events if e.name == STEP), None)
    busy = merge((e.time_range.start, e.time_range.end)
                 for e in device_events(events, device_type))
    if step is None:
        return None
    thread = step.thread
    # Every host thread's ranges (the backward's operators run on autograd's
    # device thread); the phases are the calling thread's.
    every = [(e.name, e.time_range.start, e.time_range.end, e.thread) for e in events
             if e.device_type != device_type]
    host = [(n, s, e) for n, s, e, th in every if th == thread]

    def span(ranges, pred):
        """The first start to the last end of the ranges whose name passes."""
        found = [(s, e) for n, s, e in ranges if pred(n)]
        return (min(s for s, _ in found), max(e for _, e in found)) if found else None
    phases = phase_bounds((step.time_range.start, step.time_range.end),
                          span([r[:3] for r in every], lambda n: n.startswith(BACKWARD_PREFIX)),
                          span(host, lambda n: n.startswith(OPTIMIZER_PREFIX)),
                          span(host, lambda n: n == TRANSFER))
    result = idle_by_phase(phases, busy)
    if not busy:
        for name in PHASES:
            result[name]["idle_ms"] = None
        result["busy_ms"] = result["drain"]["device_ms"] = None
        result["gaps"] = []
        return result
    named = [(n, s, e) for n, s, e, _ in every
             if n not in (STEP, TRANSFER) and not n.startswith(OPTIMIZER_PREFIX)]
    result["gaps"] = [dict(length_us=length, phase=phase, host=innermost(named, start + length / 2))
                      for start, length, phase in gaps(phases, busy)[:TOP_GAPS]]
    return result
