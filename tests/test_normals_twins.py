"""The normals' logarithm, sine and cosine of the CUDA kernels (csrc/common/
philox.cuh, host build) against the numba twin's (_numba/rng.py log_normal,
cos_sin_2pi): bit for bit, at the inputs where the algorithms switch branch or
lose accuracy and at random ones; and both within a float64 ulp of libm's
(NumPy's) log, cos and sin of the same argument, the reference's functions."""
from __future__ import annotations

import math
import struct
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _host_cpp import build
from ncdp_fast._numba import rng as M

DRIVER = r"""
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include "common/philox.cuh"

static std::uint64_t bits(double x) {
  std::uint64_t b;
  std::memcpy(&b, &x, sizeof x);
  return b;
}

// Per line, "l <bits of u>" (log_normal) or "c <bits of u2>" (cos_sin_2pi) or
// "n <seed> <block>" (normals_of_block); prints the results' bits.
int main() {
  char op;
  while (std::scanf(" %c", &op) == 1) {
    unsigned long long a, b;
    if (op == 'n') {
      if (std::scanf("%llu %llu", &a, &b) != 2) return 1;
      double z[4];
      ncdp::philox::normals_of_block(a, b, z);
      std::printf("%016" PRIx64 " %016" PRIx64 " %016" PRIx64 " %016" PRIx64 "\n", bits(z[0]),
                  bits(z[1]), bits(z[2]), bits(z[3]));
      continue;
    }
    if (std::scanf("%llx", &a) != 1) return 1;
    double x;
    std::memcpy(&x, &a, sizeof x);
    if (op == 'l') {
      std::printf("%016" PRIx64 "\n", bits(ncdp::philox::log_normal(x)));
    } else {
      double c, s;
      ncdp::philox::cos_sin_2pi(x, &c, &s);
      std::printf("%016" PRIx64 " %016" PRIx64 "\n", bits(c), bits(s));
    }
  }
  return 0;
}
"""


def _hex(x: float) -> str:
    return f"{struct.unpack('<Q', struct.pack('<d', x))[0]:016x}"


def _float(h: str) -> float:
    return struct.unpack("<d", struct.pack("<Q", int(h, 16)))[0]


@pytest.fixture(scope="module")
def cpp(tmp_path_factory):
    exe = build(DRIVER, tmp_path_factory.mktemp("normals_cpp"), "-O2")

    def run(lines):
        out = subprocess.run([str(exe)], input="".join(line + "\n" for line in lines),
                             capture_output=True, text=True, check=True).stdout.split("\n")
        return [[_float(h) for h in line.split()] for line in out if line]
    return run


def _same(x: float, y: float) -> bool:
    return _hex(x) == _hex(y)


def _ulps(x: float, y: float) -> float:
    return abs(x - y) / math.ulp(max(abs(x), abs(y), np.finfo(np.float64).tiny))


def _log_inputs(rng):
    """u1's range [2^-129, 1]: powers of two, their neighbours, the mantissas
    around sqrt(2) and sqrt(2)/2 where the reduction switches, the deep pairs'
    boundary 2^-11, and random values over every binade."""
    edges = [2.0 ** -129, 2.0 ** -128, 2.0 ** -11, 0.5, 1.0, math.sqrt(2) / 2, math.sqrt(0.5)]
    for k in range(-129, 1):
        for m in (1.0, math.sqrt(2), math.sqrt(2) / 2 * 2):
            edges.append(math.ldexp(m, k))
    near = [np.nextafter(x, d) for x in edges for d in (0.0, 2.0)]
    rand = np.ldexp(rng.uniform(0.5, 1.0, 20000), rng.integers(-128, 1, 20000))
    return [x for x in [*edges, *near, *rand] if 2.0 ** -129 <= x <= 1.0]


def _angle_inputs(rng):
    """u2 in (0, 1]: the quadrant boundaries k/4 and their neighbours (where
    2 pi u2 meets a multiple of pi/2 and the reduction's q switches), the
    smallest u2 (2^-65: words all zero), 1.0, and random values."""
    edges = [2.0 ** -65, 2.0 ** -64, 1e-10, 1.0] + [k / 8 for k in range(1, 8)]
    near = [np.nextafter(x, d) for x in edges for d in (0.0, 2.0)]
    near += [x + s * k * math.ulp(x) for x in (0.25, 0.5, 0.75) for s in (-1, 1)
             for k in range(1, 40)]
    rand = rng.uniform(0.0, 1.0, 20000)
    return [x for x in [*edges, *near, *rand] if 0.0 < x <= 1.0]


def test_log_is_the_twins_bits_and_within_an_ulp_of_libm(cpp):
    xs = _log_inputs(np.random.default_rng(0))
    got = cpp([f"l {_hex(x)}" for x in xs])
    for x, (g,) in zip(xs, got):
        want = M.log_normal(x)
        assert _same(g, want), (x, g, want)
        assert _ulps(g, math.log(x)) <= 1.0, x


def test_cos_sin_are_the_twins_bits_and_within_an_ulp_of_libm(cpp):
    xs = _angle_inputs(np.random.default_rng(1))
    got = cpp([f"c {_hex(x)}" for x in xs])
    for u2, (c, s) in zip(xs, got):
        wc, ws = M.cos_sin_2pi(u2)
        assert _same(c, wc) and _same(s, ws), (u2, c, s, wc, ws)
        t = 2.0 * np.pi * u2                     # the reference's rounded angle
        # Relative to the larger of the pair (near a zero of one of them the
        # other is near 1): the error is absolute there, a float64 ulp of 1.
        scale = math.ulp(max(abs(np.cos(t)), abs(np.sin(t))))
        assert abs(c - np.cos(t)) <= scale and abs(s - np.sin(t)) <= scale, u2


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), block=st.integers(0, 2**62 - 1))
def test_normals_of_a_block_are_the_twins_bits(cpp, seed, block):
    """A Philox block's four normals (deep pairs included where they fall) as
    the numba kernel computes them from the same stream indices."""
    (got,) = cpp([f"n {seed} {block}"])
    want = np.zeros(4)
    M.add_gaussian(want, np.uint64(seed), np.uint64(4 * block), 1.0, False, 1.0)
    assert all(_same(g, w) for g, w in zip(got, want)), (seed, block, got, want)
