"""ncdp_fast across processes, on ``torch.distributed`` (gloo on CPUs, NCCL on GPUs).

Every sharded capability here is the one-process computation cut into pieces:
the same Philox draws at the same stream offsets, the same privacy report.  The
helpers of :mod:`._group` resolve the process group, give the contiguous shard of
each rank and check, before any other collective, that all ranks were called with
the same configuration.  torch is imported lazily; with ``group=None`` and no
initialised default group a call is an ordinary one-process call.

* :func:`ntk_gram`, :func:`ntk_lambda_min`: the NTK Gram by row shards and its
  smallest eigenvalue by block Lanczos on the sharded rows (docs/architecture.md).
* :func:`release_sharded` (also ``NeuroMixGDP(...).release(..., group=g)``): the
  NeuroMixGDP release over row shards, returning a :class:`ShardedRelease` whose
  ``gather()`` / ``save()`` assemble it (docs/architecture.md, "Across ranks").
"""
from __future__ import annotations

from .._lazy import lazy_attributes
from ._group import check_same_config, rank_world, resolve_group, shard_bounds
from .ntk import lambda_min as ntk_lambda_min, ntk_gram

__all__ = ["resolve_group", "rank_world", "check_same_config", "shard_bounds", "ntk_gram",
           "ntk_lambda_min", "release_sharded", "ShardedRelease"]


# The release imports the privacy stack; loaded on first use so that the
# command line and _group users stay light.
__getattr__ = lazy_attributes(__name__, {"release_sharded": "._release",
                                         "ShardedRelease": "._sharded"})
