r"""White-box one-run audit of DP-SGD through the package's own path:
:func:`audit_dpsgd`.

m canaries, each included in the training set independently with probability
1/2, are trained on by :class:`ncdp_fast.torch.PrivacyEngine` exactly as a user
trains (``make_private_with_epsilon``: true Poisson batches from the engine's
loader, :class:`~ncdp_fast.torch.GhostClipper` clipping, noise from the
engine's stream, the engine's accountant for the claimed eps).

The canaries (Nasr et al. 2023, Steinke et al. 2023):

* ``"dirac"``: canary i is the input B e_i on its own coordinate of the canary
  layer, B = 10 C, with a loss linear in the model's output, so its gradient is
  -B e_i at every step whatever the weights: clipped, a Dirac of norm C on its
  own coordinate -- the worst case for the Gaussian mechanism.
* ``"input"``: canary i is B u_i, u_i a random unit vector over all inputs
  (real features and canary coordinates); its clipped gradient is C u_i, seen
  through every other sample's gradient (input-space canaries).

What the auditor observes (``observe``): ``"steps"``, the parameters after
every step, i.e. each step's noisy gradient (white box, the strongest
observation a user's checkpoints could give); ``"final"``, only the trained
model (weaker; for SGD without momentum it holds the sum of the steps).
"""
from __future__ import annotations

import math
import time

import numpy as np

from .._arrays import require_torch
from .._validate import check_choice, check_int, check_positive, check_probability
from .guess import AuditResult, bound_from_scores, plan_k, subsampled_gaussian_score

__all__ = ["audit_dpsgd", "DiracModel", "canary_inputs"]

_MAGNITUDE = 10.0   # canary input norm / C: the gradient is clipped, never at the edge


def _torch():
    return require_torch("ncdp_fast.audit.audit_dpsgd")


def DiracModel(d_real: int, m: int):  # noqa: N802 - a class factory (torch is imported late)
    """f(x) = features(x[:, :d_real]) + canary(x[:, d_real:]): two ``nn.Linear``
    (float64), the second (no bias) holding one coordinate per canary."""
    torch = _torch()

    class _DiracModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.d_real = d_real
            self.features = torch.nn.Linear(d_real, 1, dtype=torch.float64)
            self.canary = torch.nn.Linear(m, 1, bias=False, dtype=torch.float64)
            with torch.no_grad():
                self.canary.weight.zero_()

        def forward(self, x):
            return (self.features(x[:, :self.d_real]) + self.canary(x[:, self.d_real:]))[:, 0]

        def flat_weights(self):
            """(d_real + m,) float64 copy of both weights, in input order."""
            return torch.cat([self.features.weight.detach()[0],
                              self.canary.weight.detach()[0]]).clone()

    return _DiracModel()


def canary_inputs(kind: str, m: int, d_real: int, max_grad_norm: float, rng):
    """(X (m, d_real + m), U (m, d_real + m)): each canary's input and the unit
    direction of its clipped gradient (its score projects each step on it)."""
    d = d_real + m
    if kind == "dirac":
        U = np.zeros((m, d))
        U[np.arange(m), d_real + np.arange(m)] = 1.0
    else:
        U = rng.standard_normal((m, d))
        U /= np.linalg.norm(U, axis=1, keepdims=True)
    return _MAGNITUDE * max_grad_norm * U, U


def _seeds(seed):
    """Membership rng, the engine's noise key and the plan's rng: independent
    streams of one SeedSequence (OS entropy when ``seed`` is None)."""
    ss = np.random.SeedSequence(seed)
    member, noise, plan = ss.spawn(3)
    key = int(noise.generate_state(2, np.uint32).view(np.uint64)[0])
    return np.random.default_rng(member), key, np.random.default_rng(plan)


def claimed_mu(sigma: float, q: float, steps: int) -> float:
    """The GDP parameter of ``steps`` Poisson-subsampled Gaussian steps as claimed:
    sqrt(T) / sigma exactly at q = 1, the CLT's mu below (used only to plan k)."""
    if sigma == 0:
        return float("inf")
    if q >= 1.0:
        return math.sqrt(steps) / sigma
    from ..privacy import poisson_gdp_mu
    return float(poisson_gdp_mu(sigma, q, steps))


def resolve_k(k, m, mu, delta, confidence, rng):
    """``k="plan"``: :func:`plan_k` for the claimed mu (capped: beyond mu = 8 every
    plan is the largest k); anything else is passed on."""
    if isinstance(k, str):
        check_choice(k, "k", ("plan",))
        return plan_k(m, min(mu, 8.0), delta=delta, confidence=confidence, rng=rng)
    return k


def audit_dpsgd(*, canaries: int = 1000, epsilon: float = 4.0, delta: float = 1e-5,
                epochs: int = 10, batches: int = 1, canary: str = "dirac",
                observe: str = "steps", score="lr", max_grad_norm: float = 1.0,
                real_samples: int = 256, real_features: int = 16, accountant: str = "prv",
                confidence: float = 0.95, k="plan", seed=None) -> AuditResult:
    r"""One-run audit of DP-SGD as :class:`~ncdp_fast.torch.PrivacyEngine` trains.

    Trains :func:`DiracModel` on ``real_samples`` real points plus each of
    ``canaries`` canaries included w.p. 1/2, with ``make_private_with_epsilon``
    (target ``epsilon`` at ``delta`` after ``epochs`` epochs of ``batches``
    Poisson batches: sample rate q = 1 / batches), SGD at lr 1, a loss linear in
    the output (sum over the batch), then scores, guesses and bounds
    (:func:`~ncdp_fast.audit.guess.bound_from_scores`).

    Args:
        canaries: m (>= 2).
        epsilon, delta: the claim the run is calibrated to; the result's
            ``epsilon_claimed`` is the engine's ``get_epsilon(delta)`` after the run.
        epochs, batches: steps = epochs * batches, q = 1 / batches.
        canary: ``"dirac"`` or ``"input"`` (module docstring).
        observe: ``"steps"`` (each step's noisy gradient) or ``"final"`` (the
            trained model only).
        score: ``"lr"`` (per-step likelihood ratio under the run's own sigma and
            q; with ``observe="final"``, the projection of the total update),
            ``"sum"`` (sum of the steps' projections), or a callable
            ``(T, m) float64 -> (m,)`` given each step's projection on each
            canary's direction, in units of its clipped gradient's signal
            (``(1, m)`` with ``observe="final"``); higher says IN.  Chosen
            before the run: a score picked after seeing the results voids the
            confidence.
        max_grad_norm: C.
        real_samples, real_features: the real data (always included).
        accountant: the engine's accountant (``"prv"``, ``"pld"``, ``"rdp"``, ``"gdp"``).
        confidence: of each bound; 1 - confidence is the chance that an honest
            run's bound exceeds its true eps.
        k: guesses per side: ``"plan"`` (one k per analysis, planned from the
            claimed sigma, q and steps alone, no observation of the run:
            :func:`~ncdp_fast.audit.plan_k`),
            an int or a pair, or None (a grid, Bonferroni-corrected).
        seed: None (OS entropy) or an int fixing membership, data and noise.

    Returns:
        :class:`~ncdp_fast.audit.guess.AuditResult`; ``details`` holds the
        noise multiplier, q, steps, canary kind, observation and wall time.
    """
    torch = _torch()
    from ..torch import PrivacyEngine

    m = check_int(canaries, "canaries", 2)
    check_positive(epsilon, "epsilon")
    check_probability(delta, "delta", one=False)
    epochs = check_int(epochs, "epochs", 1)
    batches = check_int(batches, "batches", 1)
    check_choice(canary, "canary", ("dirac", "input"))
    check_choice(observe, "observe", ("steps", "final"))
    if not callable(score):
        check_choice(score, "score", ("lr", "sum"))
    c = check_positive(max_grad_norm, "max_grad_norm")
    n_real = check_int(real_samples, "real_samples", 0)
    d_real = check_int(real_features, "real_features", 1)
    start = time.perf_counter()

    rng, noise_key, plan_rng = _seeds(seed)
    membership = rng.random(m) < 0.5
    Xc, U = canary_inputs(canary, m, d_real, c, rng)
    Xr = np.zeros((n_real, d_real + m))
    Xr[:, :d_real] = rng.standard_normal((n_real, d_real)) / math.sqrt(d_real)
    yr = np.where(Xr[:, :d_real] @ rng.standard_normal(d_real) >= 0, 1.0, -1.0)
    X = np.concatenate([Xr, Xc[membership]])
    y = np.concatenate([yr, np.ones(int(membership.sum()))])
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(y))
    n = len(dataset)
    if n == 0:
        raise ValueError("real_samples: expected real samples or included canaries, got an "
                         "empty training set")
    loader = torch.utils.data.DataLoader(dataset, batch_size=math.ceil(n / batches))
    if len(loader) != batches:
        raise ValueError(f"batches: expected a number of batches {n} samples can be cut into "
                         f"(got {batches}, the loader has {len(loader)}); use fewer batches "
                         "or more real_samples")

    model = DiracModel(d_real, m)
    with torch.no_grad():       # from the audit's generator, not torch's global one
        model.features.weight.copy_(torch.from_numpy(rng.standard_normal((1, d_real))
                                                     / math.sqrt(d_real)))
        model.features.bias.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = PrivacyEngine(accountant=accountant)
    private, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=epsilon,
        target_delta=delta, epochs=epochs, max_grad_norm=c, loss_reduction="sum",
        seed=noise_key)
    sigma, q = float(optimizer.noise_multiplier), float(engine.sample_rate)

    Ut = torch.from_numpy(U)
    w0 = prev = model.flat_weights()
    steps = []
    for _ in range(epochs):
        for xb, yb in loader:
            optimizer.zero_grad()
            (-(yb * private(xb)).sum()).backward()
            optimizer.step()
            now = model.flat_weights()
            if observe == "steps":
                steps.append((Ut @ (now - prev)).numpy())  # -grad . u_i: C b + noise
            prev = now
    obs = np.stack(steps) if observe == "steps" else (Ut @ (prev - w0)).numpy()[None, :]
    obs /= c                                            # in units of the canary's signal C
    claimed = float(engine.get_epsilon(delta))

    if callable(score):
        scores = np.asarray(score(obs), dtype=np.float64)
        if scores.shape != (m,):
            raise ValueError(f"score: expected the callable to return ({m},) scores, got shape "
                             f"{scores.shape}")
    elif score == "lr" and observe == "steps":
        scores = subsampled_gaussian_score(obs, sigma, q)
    else:
        scores = obs.sum(axis=0)
    details = dict(audit="dpsgd", canary=canary, observe=observe,
                   score=score if isinstance(score, str) else "callable",
                   noise_multiplier=sigma, sample_rate=q, steps=epochs * batches,
                   max_grad_norm=c, real_samples=n_real, accountant=accountant,
                   epsilon_target=float(epsilon))
    k = resolve_k(k, m, claimed_mu(sigma, q, epochs * batches), delta, confidence, plan_rng)
    result = bound_from_scores(scores, membership, delta=delta, confidence=confidence, k=k,
                               epsilon_claimed=claimed, details=details)
    result.details["wall_s"] = time.perf_counter() - start
    return result
