"""ncdp_fast: accelerated differentially private learning on pretrained representations.

Ops (one function each; NumPy, torch CPU/CUDA tensors or CuPy arrays in, the
same type out): :func:`gaussian`, :func:`clip_and_noise`,
:func:`clip_and_noise_linear`, :func:`clip_and_noise_layers`, :func:`mix`,
:func:`poisson_batches`, :func:`ntk_gram`; NTK analysis in :mod:`ncdp_fast.ntk`.  Drop-ins for
torch training loops live in :mod:`ncdp_fast.torch`; :func:`info` says what
this installation can do.  :class:`NoiseStream` hands disjoint ranges of one
secret Philox key to every noisy component of a workflow.
"""
from __future__ import annotations

__version__ = "0.1.0"

from ._clip import (ClipResult, GhostBlock, LayersClipResult, LinearClipResult, clip_and_noise,
                    clip_and_noise_layers, clip_and_noise_linear)
from ._info import info
from ._mix import BatchPlan, MixResult, mix, poisson_batches
from ._ntk import ntk_gram
from ._rng import GAUSSIAN_TAIL_BOUND, gaussian
from ._stream import NoiseReuseWarning, NoiseStream

__all__ = ["__version__", "info", "gaussian", "GAUSSIAN_TAIL_BOUND", "clip_and_noise", "clip_and_noise_linear",
           "clip_and_noise_layers", "ClipResult", "LinearClipResult", "LayersClipResult", "GhostBlock",
           "mix", "poisson_batches", "MixResult", "BatchPlan", "ntk_gram", "NoiseStream",
           "NoiseReuseWarning"]
