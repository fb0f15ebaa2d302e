"""Serial/parallel twins of numba kernels.

Handing a small job to a thread pool costs more than the job: worse, in a torch
training loop torch's OpenMP workers are still spinning on the other cores when
numba's pool wakes up, and a hand-off can wait a scheduler quantum (measured:
~3 ms for a 7,680-element noise vector, 40x the work).  So each kernel is
compiled twice from one Python function, and calls below a work threshold run
serially on the calling thread.  Both twins compute the same thing in the same
order (prange splits by fixed chunks/slabs, never by thread count), so the
choice never changes a result.
"""
from __future__ import annotations

import threading
import types

import numba
from numba import njit

# Elements touched below which a kernel runs on the calling thread (~8 MB of
# float32: a few hundred microseconds serially).  Lower thresholds lost more to
# waking and then contending with torch's pool than the second core gained
# (measured on the (512, 768, 10) GhostClipper step).
PARALLEL_MIN_WORK = 1 << 21

# numba's default "workqueue" threading layer aborts the process when two Python
# threads enter parallel regions at once ("Concurrent access has been
# detected"); TBB and OpenMP allow it, but which layer numba picks depends on
# what the machine has installed.  Parallel launches therefore take this lock
# (uncontended it costs well under a microsecond; serial twins never take it),
# so concurrent calls from several threads are correct on every layer.
_PARALLEL_LOCK = threading.Lock()


class SizedKernel:
    """Call the serial twin when ``work(*args) < PARALLEL_MIN_WORK``."""

    def __init__(self, py_func, work, flags):
        self.work = work
        self.parallel = njit(cache=True, parallel=True, **flags)(py_func)
        # A distinct function object (own qualname) keeps the two on-disk caches apart.
        twin = types.FunctionType(py_func.__code__, py_func.__globals__,
                                  py_func.__name__ + "_serial", py_func.__defaults__,
                                  py_func.__closure__)
        twin.__qualname__ = py_func.__qualname__ + "_serial"
        self.serial = njit(cache=True, **flags)(twin)
        self.__doc__ = py_func.__doc__
        self.__name__ = py_func.__name__

    def __call__(self, *args):
        if self.work(*args) >= PARALLEL_MIN_WORK and numba.get_num_threads() > 1:
            with _PARALLEL_LOCK:
                return self.parallel(*args)
        return self.serial(*args)


def sized_kernel(work, **flags):
    """Decorator: ``@sized_kernel(lambda g, *_: g.size, fastmath=...)``."""
    def wrap(py_func):
        return SizedKernel(py_func, work, flags)
    return wrap
