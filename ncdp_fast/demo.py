"""``ncdp-fast demo``: a private linear probe on scikit-learn's digits.

DP-SGD with Poisson sampling (each example joins each step's batch
independently with probability q = batch_size / n) and :class:`GhostClipper`,
next to the same probe trained without privacy on the same batches.  The
features are pixel intensities scaled by the constant 1/16 (no statistic of the
private data is fitted).  The privacy spent is reported by the PLD accountant
of :mod:`ncdp_fast.privacy` (add/remove neighbours).
"""
from __future__ import annotations

import secrets
import time

import numpy as np


def _epsilon(noise_multiplier, sample_rate, steps, delta):
    try:
        from .privacy import epsilon_poisson_gaussian
    except ImportError as exc:  # pragma: no cover - privacy extra missing
        return None, str(exc)
    try:
        return epsilon_poisson_gaussian(noise_multiplier, sample_rate, steps, delta,
                                        accountant="pld"), None
    except ImportError as exc:  # dp-accounting not installed
        return None, str(exc)


def run_demo(*, epochs=20, noise_multiplier=3.0, max_grad_norm=1.0, batch_size=256, delta=1e-5,
             lr=1.0, seed=None, verbose=True) -> dict:
    import torch
    from sklearn.datasets import load_digits
    from torch import nn

    from . import info
    from .torch import GhostClipper

    seed = secrets.randbits(63) if seed is None else int(seed)
    rng = np.random.default_rng(seed)
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    perm = rng.permutation(len(X))
    n_test = len(X) // 5
    test, train = perm[:n_test], perm[n_test:]
    Xtr, ytr = torch.from_numpy(X[train]), torch.from_numpy(y[train])
    Xte, yte = torch.from_numpy(X[test]), torch.from_numpy(y[test])
    n = len(train)
    q = batch_size / n
    steps = int(round(epochs / q))
    batches = [np.flatnonzero(rng.random(n) < q) for _ in range(steps)]

    def train_probe(private: bool):
        torch.manual_seed(seed % 2**31)
        model = nn.Linear(64, 10)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        clipper = GhostClipper(model, max_grad_norm=max_grad_norm,
                               noise_multiplier=noise_multiplier, expected_batch_size=batch_size,
                               loss_reduction="sum", seed=int(rng.integers(2**63))) \
            if private else None
        t0 = time.perf_counter()
        for idx in batches:
            opt.zero_grad()
            idx_t = torch.from_numpy(idx)
            loss = nn.functional.cross_entropy(model(Xtr[idx_t]), ytr[idx_t], reduction="sum")
            if private:
                # Sum-reduced loss, so an empty Poisson batch still runs (and still
                # gets its noise); divide by the *expected* batch size, never the
                # realized one.
                loss.backward()
                clipper.privatize_()
                for p in model.parameters():
                    p.grad /= batch_size
            else:
                if len(idx) == 0:
                    continue
                (loss / len(idx)).backward()
            opt.step()
        elapsed = time.perf_counter() - t0
        with torch.no_grad():
            acc = float((model(Xte).argmax(1) == yte).float().mean())
        return acc, elapsed

    acc_np, t_np = train_probe(private=False)
    acc_dp, t_dp = train_probe(private=True)
    eps, why = _epsilon(noise_multiplier, q, steps, delta)
    report = dict(n_train=n, n_test=n_test, steps=steps, sample_rate=q, epochs=epochs,
                  noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, delta=delta,
                  accuracy_nonprivate=acc_np, accuracy_private=acc_dp, epsilon=eps,
                  seconds_nonprivate=t_np, seconds_private=t_dp, seed=seed)
    if verbose:
        info()
        print()
        print(f"digits linear probe: n_train={n}, n_test={n_test}, Poisson q={q:.4f} "
              f"(expected batch {batch_size}), {steps} steps (~{epochs} epochs)")
        print(f"  non-private probe      accuracy {acc_np:.3f}   ({t_np:.2f} s)")
        eps_text = f"epsilon={eps:.2f} at delta={delta:g} (PLD)" if eps is not None else \
            f"epsilon: not computed ({why})"
        print(f"  DP probe (GhostClipper) accuracy {acc_dp:.3f}   ({t_dp:.2f} s)   "
              f"sigma={noise_multiplier}, C={max_grad_norm}, {eps_text}")
    return report
