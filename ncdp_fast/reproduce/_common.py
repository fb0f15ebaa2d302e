"""What the torch reproductions share: the command line every one takes (--out,
--quick, --seed), seeds derived from one master seed, progress lines with a
time estimate, the machine's record, and matplotlib set up for files."""
from __future__ import annotations

import argparse
import os
import secrets
import time

import numpy as np


def log(msg: str) -> None:
    print(msg, flush=True)


def parser(prog: str, doc: str, quick: str) -> argparse.ArgumentParser:
    """The options every reproduction has; ``quick`` says what --quick does."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--seed", type=int, default=None, help="master seed (default: from the OS)")
    return ap


def master_seed(seed: int | None) -> int:
    """``seed``, or 63 bits from the OS (then recorded in the report)."""
    return seed if seed is not None else secrets.randbits(63)


def derive_seed(base: int, *parts: int) -> int:
    """An independent 64-bit seed for each (base, parts): one per arm and purpose."""
    ss = np.random.SeedSequence([base, *parts])
    return int(ss.generate_state(1, np.uint64)[0])


class Progress:
    """Prints ``label: step i/n, <extra>, s/step, eta`` at most every ``every``
    seconds and at the last step."""

    def __init__(self, label: str, total: int, every: float = 15.0):
        self.label, self.total, self.every = label, total, every
        self.t0 = self.last = time.perf_counter()
        self.done = 0

    def step(self, extra: str = "") -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self.last > self.every or self.done == self.total:
            self.last = now
            rate = (now - self.t0) / self.done
            log(f"  {self.label}: step {self.done}/{self.total}{', ' + extra if extra else ''}, "
                f"{rate:.1f} s/step, eta {rate * (self.total - self.done):.0f} s")

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0


def cpu_meta(torch_mod=None) -> dict:
    """The machine's record for a CPU run (what write_report's header shows), with
    the load average: the project's machine is shared, and timings say so."""
    from .._report import machine
    m = machine(torch_mod)
    threads = m.get("torch_threads", m["numba_threads"])
    return dict(m, device=f"CPU: {m['cpu']}, {threads} threads", device_tag="cpu",
                load_average=[round(x, 2) for x in os.getloadavg()])


def axes(figsize=(6, 4)):
    """A matplotlib figure and axes drawn off-screen (Agg); save it with
    :func:`ncdp_fast._report.save_figure`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(figsize=figsize)
