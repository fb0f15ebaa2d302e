"""Concurrent calls from several Python threads on every numba threading layer
(audit item 7: under "workqueue" two threads in parallel regions aborted the
process with rc 134).  Each layer runs in a fresh process: the layer is fixed
at numba's first parallel launch."""
import subprocess
import sys
import textwrap

import pytest

CODE = textwrap.dedent("""
    import threading, numpy as np, ncdp_fast as nf
    from ncdp_fast._numba import _dispatch
    _dispatch.PARALLEL_MIN_WORK = 1          # every call takes the parallel twin
    g = np.random.default_rng(0).standard_normal((64, 4096))
    ref = nf.clip_and_noise(g, max_norm=1.0, noise_multiplier=1.0, seed=3, offset=0).grad
    out, errors = [None] * 8, []
    def work(i):
        try:
            for _ in range(20):
                # Disjoint explicit offsets per thread: no noise is shared.
                r = nf.clip_and_noise(g, max_norm=1.0, noise_multiplier=0.0, seed=3 + i,
                                      offset=10**6 * (1 + _))
            out[i] = nf.clip_and_noise(g, max_norm=1.0, noise_multiplier=1.0, seed=3,
                                       offset=(i + 1) * 4096).grad
        except Exception as e:
            errors.append(repr(e))
    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    [t.start() for t in ts]; [t.join() for t in ts]
    assert not errors, errors
    for i in range(8):
        exp = nf.clip_and_noise(g, max_norm=1.0, noise_multiplier=1.0, seed=3,
                                offset=(i + 1) * 4096).grad
        assert np.array_equal(out[i], exp), i
    import numba
    print("LAYER", numba.threading_layer())
""")


@pytest.mark.parametrize("layer", ["workqueue", "default"])
def test_concurrent_calls_from_threads(layer):
    env = {"NUMBA_THREADING_LAYER": layer, "NUMBA_NUM_THREADS": "2"}
    import os
    full = dict(os.environ, **env, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", CODE], env=full, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    if layer == "workqueue":
        assert "LAYER workqueue" in r.stdout
