"""Row-sharded NTK Gram matrices and their smallest eigenvalue across ranks.

The empirical NTK of an MLP is a sum of Hadamard products of layer factors
(004_f44587b9249a6ca9.txt, "Bounding the smallest eigenvalue of the NTK"):

    K = sum_l (F_l F_l^T) o (B_l B_l^T),        K[i, j] = sum_l <F_l,i, F_l,j> <B_l,i, B_l,j>

(``ncdp_fast._ntk``: F_l the layer inputs, B_l the backpropagated matrices,
trace-averaged over the outputs).  Row i of every factor depends on the input
x_i alone, so a rank that owns rows ``R_r`` of K computes the factors of its own
inputs, and ``K[R_r, R_s] = sum_l (F_l[R_r] F_l[R_s]^T) o (B_l[R_r] B_l[R_s]^T)``
needs only rank s's factor rows: each rank broadcasts its factors, one layer at
a time.  The diagonal block is the symmetric kernel's; the tile K[R_lo, R_hi] of
two ranks is computed once, half by each (lo: its rows against the first half of
hi's; hi: the second half of its rows against all of lo's), and the halves are
swapped at the end, so the ranks together do the one-process n^2 / 2 entries and
the stacked rows are exactly symmetric.  K's n x n never exists on one rank (a
rank holds its n_r x n rows), nor do all n rows of the factors (one layer's
factors of one peer at a time).

:func:`lambda_min` finds the smallest eigenvalue of the sharded K by block
Lanczos with full re-orthogonalisation whose vectors are sharded like K's rows:
a product ``K Q`` is each rank's rows times the all-gathered block, and every
inner product is a local partial summed over the ranks.  Reductions are an
all-gather followed by a sum in rank order, so every rank sees the same bits
whatever gloo's algorithms do; the stop decision and the result are rank 0's,
broadcast (docs/architecture.md, "Across ranks: row-sharded NTK Grams").

One process (``group=None`` and no initialised ``torch.distributed``) is the
case world = 1 of the same code; torch is imported only for a real group.
"""
from __future__ import annotations

from ._ntk_comm import _Comm
from ._ntk_eig import _block_lanczos, _orthonormal_block, _smallest_ritz_pair, lambda_min
from ._ntk_gram import factor_widths, ntk_gram

# The job of each piece: _ntk_comm (the collectives and the argument agreement),
# _ntk_gram (the sharded Gram), _ntk_eig (its smallest eigenvalue).
__all__ = ["ntk_gram", "lambda_min", "factor_widths"]
