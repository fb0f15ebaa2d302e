"""PLD composition of Gaussian steps with its memory forecast before it is allocated.

The composition is dp-accounting's own (``PLDAccountant`` on the same events:
``from_gaussian_mechanism`` per group, ``self_compose``, ``compose``), taken one
group at a time so that the memory each stage will ask for is known first.
Why: a PLD's grid grows as 1/sigma^2 (losses up to about 1/(2 sigma^2) + 10/sigma
nats, in steps of the discretisation interval) and a self-composition's FFT as
far as dp-accounting's Chernoff bound allows, which for a small sample rate is
nearly steps times the grid.  Past the machine's memory the operating system
kills the process with no message (the seventh audit: q = 1e-6, sigma = 0.01,
10 steps, killed beside other work; alone it peaked at 13.6 GB after 20
minutes).  A stage whose forecast exceeds the memory available is refused,
naming the caller's argument.

The bytes per point are measured with dp-accounting 0.6.0 (docs/privacy.md,
"PLD memory"): building one step's PLD took 172 to 228 bytes per grid point
(both neighbouring directions; the most at 6e7 points), a self-composition
with its epsilon query at most 130 bytes per FFT point, peak resident memory
over the process's start.
"""
from __future__ import annotations

import math
import os

from ._validate import import_dp_accounting

__all__ = ["PLDStages", "pld_epsilon_of", "available_memory"]

# Forecast bytes per point, a margin above the largest measured (docstring).
_BUILD_BYTES_PER_POINT = 260
_COMPOSE_BYTES_PER_POINT = 140
# dp-accounting's defaults inside PLDAccountant (its Gaussian tail truncation
# and the tail mass a self-composition may drop).
_LOG_MASS_TRUNCATION = -50.0
_TAIL_MASS_TRUNCATION = 1e-15


def _read_int(path: str):
    try:
        with open(path) as f:
            text = f.read().split()[0]
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() else None


def available_memory():
    """Bytes this process may still allocate: the smaller of the kernel's
    MemAvailable (psutil's available memory where /proc/meminfo cannot be
    read, as on macOS, if psutil is installed) and the headroom under a
    cgroup (v2 or v1) limit; None where none can be read (then no forecast
    is checked)."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    if not found:
        try:
            import psutil
            found.append(int(psutil.virtual_memory().available))
        except Exception:    # not installed, or no reading on this system
            pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        cap, used = _read_int(limit), _read_int(usage)
        if cap is not None and used is not None and cap < 2 ** 60:   # v1 "no limit" is ~2^63
            found.append(max(0, cap - used))
    return min(found) if found else None


def _grid_points(dpa, sigma: float, q: float) -> float:
    """Grid points of one step's PLD at interval 1 (divide by the interval):
    the connect-the-dots loss range, closed form, both directions."""
    M = dpa.pld.privacy_loss_mechanism
    widest = 0.0
    for adjacency in (M.AdjacencyType.REMOVE, M.AdjacencyType.ADD):
        b = M.GaussianPrivacyLoss(sigma, sensitivity=1.0, pessimistic_estimate=True,
                                  sampling_prob=q, adjacency_type=adjacency,
                                  log_mass_truncation_bound=_LOG_MASS_TRUNCATION
                                  ).connect_dots_bounds()
        widest = max(widest, float(b.epsilon_upper) - float(b.epsilon_lower))
    return widest


def _fft_points(pld, steps: int) -> int:
    """FFT length dp-accounting's self_compose(steps) will take, the larger of
    the two directions (sparse PMFs, at most a thousand points, count 0)."""
    from scipy import fft
    common = import_dp_accounting().pld.common
    longest = 0
    for pmf in (pld._pmf_remove, pld._pmf_add):
        probs = getattr(pmf, "_probs", None)
        if probs is None:
            continue
        lo, hi = common.compute_self_convolve_bounds(probs, steps, _TAIL_MASS_TRUNCATION)
        longest = max(longest, fft.next_fast_len(max(hi - lo + 1, len(probs))))
    return longest


def _length(pld) -> int:
    return max(len(getattr(p, "_probs", ())) for p in (pld._pmf_remove, pld._pmf_add))


class PLDStages:
    """Builds and composes Gaussian PLDs (dp-accounting's, add-or-remove-one,
    pessimistic connect-the-dots) with each stage's memory forecast first: a
    stage past :func:`available_memory` raises ``ValueError`` naming ``what``
    (the caller's argument) before it allocates."""

    def __init__(self, interval: float, what: str):
        self.dpa = import_dp_accounting()
        self.dist = self.dpa.pld.privacy_loss_distribution
        self.interval, self.what = interval, what
        self.avail = available_memory()

    def refuse(self, sigma, q, why, need=None):
        raise ValueError(
            f"{self.what}: the PLD accountant cannot compose this many steps at noise "
            f"multiplier {sigma!r} and sample rate {q!r} ({why}); accountant='rdp' composes "
            "any number in constant memory, a coarser value_discretization_interval shrinks "
            "the PLD" + ("" if need is None else f" (forecast {need / 2 ** 30:.3g} GiB, "
                                                  f"available {self.avail / 2 ** 30:.3g} GiB)"))

    def _check(self, sigma, q, need, stage):
        if self.avail is not None and need > self.avail:
            self.refuse(sigma, q, f"{stage} would not fit in memory", need)

    def one_step(self, sigma: float, q: float, named=None):
        """One step's PLD: sigma's Gaussian, Poisson-subsampled at rate q (q = 1:
        not); errors name the noise multiplier ``named`` (default sigma)."""
        named = sigma if named is None else named
        self._check(named, q, _BUILD_BYTES_PER_POINT
                    * (_grid_points(self.dpa, sigma, q) / self.interval + 1),
                    "one step's privacy loss distribution")
        kw = {} if q == 1.0 else {"sampling_prob": q}
        try:
            return self.dist.from_gaussian_mechanism(
                standard_deviation=sigma, value_discretization_interval=self.interval,
                neighboring_relation=self.dpa.NeighboringRelation.ADD_OR_REMOVE_ONE, **kw)
        except (MemoryError, OverflowError) as exc:
            self.refuse(named, q, f"{type(exc).__name__}: {exc}")

    def self_compose(self, pld, steps: int, sigma: float, q: float):
        """``pld`` composed with itself ``steps`` times (sigma, q name it in errors)."""
        try:
            # Untruncated, the FFT is at most steps x the grid (next_fast_len adds
            # well under 5 %); only past that is dp-accounting's Chernoff bound,
            # which self_compose computes again, worth its pass here.
            if self.avail is not None and \
                    1.05 * _COMPOSE_BYTES_PER_POINT * _length(pld) * steps > self.avail:
                self._check(sigma, q, _COMPOSE_BYTES_PER_POINT * _fft_points(pld, steps),
                            f"the composition of {steps} steps")
            return pld.self_compose(steps)
        except (MemoryError, OverflowError) as exc:
            # 1e12 steps asked a 38 GiB PLD, 1e30 overflowed a C size (sixth audit).
            self.refuse(sigma, q, f"{type(exc).__name__}: {exc}")

    def gaussian(self, sigma: float, q: float, steps: int):
        """T steps of the Gaussian at rate q, as dp-accounting's PLDAccountant builds them."""
        if q == 1.0:
            # T Gaussian steps are one Gaussian of sigma / sqrt(T).
            return self.one_step(sigma / math.sqrt(steps), 1.0, named=sigma)
        return self.self_compose(self.one_step(sigma, q), steps, sigma, q)

    def compose(self, a, b, sigma: float, q: float):
        try:
            self._check(sigma, q, _COMPOSE_BYTES_PER_POINT * (_length(a) + _length(b)),
                        "the composition with the history's other steps")
            return a.compose(b)
        except (MemoryError, OverflowError) as exc:
            self.refuse(sigma, q, f"{type(exc).__name__}: {exc}")


def pld_epsilon_of(groups, interval: float, what: str):
    """delta -> epsilon of the Gaussian groups ``{(sigma, q): steps}`` by
    dp-accounting's PLD, add-or-remove-one, composed as its PLDAccountant
    composes their events, each stage's memory forecast first
    (:class:`PLDStages`)."""
    stages = PLDStages(interval, what)
    total = stages.dist.identity(value_discretization_interval=interval)
    for (sigma, q), steps in groups.items():
        if q == 0.0:
            continue
        if sigma == 0.0:
            return lambda delta: math.inf
        total = stages.compose(total, stages.gaussian(sigma, q, steps), sigma, q)
    return lambda delta: float(total.get_epsilon_for_delta(delta))
