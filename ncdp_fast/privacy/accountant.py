r"""A privacy accountant for training loops, serialisable to JSON.

Neighbouring relation: add/remove one record, for every event and accountant.

Two kinds of event are recorded:

* :class:`GaussianEvent` ``(noise_multiplier, sample_rate, steps)`` -- ``steps``
  compositions of the Poisson-subsampled Gaussian mechanism (DP-SGD; NoisyGD is
  ``sample_rate = 1``). Consecutive calls with the same (sigma, q) are merged.
* :class:`ZCDPEvent` ``(rho, count)`` -- ``count`` mechanisms each known only to be
  rho-zCDP (e.g. from :func:`ncdp_fast.privacy.gaussian_zcdp`).

How :meth:`Accountant.epsilon` composes them:

* ``"pld"`` (default): all Gaussian events composed in one dp-accounting
  :class:`~dp_accounting.pld.PLDAccountant` composition (pessimistic
  discretisation; stage by stage, each stage's memory forecast first). A bare
  rho-zCDP guarantee does not determine a privacy loss distribution, so a history
  with zCDP events raises ``ValueError`` here; record NoisyGD steps as Gaussian events
  (``step(noise_multiplier=..., sample_rate=1.0)``) to get PLD accounting for them.
* ``"rdp"``: dp-accounting :class:`~dp_accounting.rdp.RdpAccountant`; a rho-zCDP
  event enters as the RDP curve :math:`\varepsilon(\alpha) = \rho\alpha`
  (``ZCDpEvent``) and RDP curves add.
* ``"gdp"``: :math:`\mu^2` adds over events (Dong et al. 2022, Cor. 2; Bu et al. 2020
  Thm 5 for the CLT part): :math:`\mu^2 = \sum q^2T(e^{1/\sigma^2}-1)` for q < 1
  (CLT approximation) and :math:`T/\sigma^2` for q = 1 (exact). zCDP events raise
  (rho-zCDP does not imply any mu-GDP).
* ``"zcdp"``: total :math:`\rho = \sum T/(2\sigma^2) + \sum \text{count}\cdot\rho`,
  converted by the Canonne--Kamath--Steinke bound; only for histories without
  subsampled (q < 1) events. Also available as :meth:`Accountant.zcdp_rho`.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple, Union

from .._validate import (check_bool, check_choice, check_delta, check_nonneg, check_pos_int,
                         check_positive, check_probability)
from ._validate import check_discretization_interval, import_dp_accounting
from .gdp import warn_clt
from .subsampled import (
    DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    accountable_groups,
    dpa_epsilon_of,
    history_event,
)
from . import truncation
from .truncation import beyond_truncation, epsilon_with_truncation, gdp_epsilon, zcdp_epsilon

__all__ = ["Accountant", "GaussianEvent", "ZCDPEvent"]

_FORMAT = "ncdp_fast.privacy.Accountant"
_VERSION = 1
_ACCOUNTANTS = ("pld", "rdp", "gdp", "zcdp")


class GaussianEvent(NamedTuple):
    """``steps`` compositions of the Poisson(``sample_rate``)-subsampled Gaussian
    mechanism with noise multiplier ``noise_multiplier`` (std / L2 sensitivity).

    A named tuple ``(noise_multiplier, sample_rate, steps)``: the entry format
    of Opacus's ``accountant.history``, so code written for it reads ours."""

    noise_multiplier: float
    sample_rate: float
    steps: int

    def to_dict(self) -> dict:
        return {
            "type": "poisson_gaussian",
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
        }


@dataclass(frozen=True)
class ZCDPEvent:
    """``count`` mechanisms, each rho-zCDP."""

    rho: float
    count: int

    def to_dict(self) -> dict:
        return {"type": "zcdp", "rho": self.rho, "count": self.count}


Event = Union[GaussianEvent, ZCDPEvent]


class Accountant:
    r"""Records privacy events of a run and answers epsilon(delta).

    Neighbouring relation: add/remove one record. Accountants: ``"pld"``
    (default, dp-accounting PLD, rigorous), ``"rdp"`` (dp-accounting RDP, rigorous),
    ``"gdp"`` (CLT approximation), ``"zcdp"`` (no subsampling only); see the module
    docstring for how events of different kinds compose under each.

    Example::

        acc = Accountant()
        for _ in range(steps):
            ...
            acc.step(noise_multiplier=1.1, sample_rate=256 / 60000)
        eps = acc.epsilon(1e-5)
        open("privacy.json", "w").write(acc.to_json())
    """

    def __init__(self) -> None:
        self._events: list[Event] = []

    # -- recording -----------------------------------------------------------------
    def step(self, *, noise_multiplier, sample_rate=1.0, steps=1) -> "Accountant":
        r"""Record ``steps`` steps of the Poisson-subsampled Gaussian mechanism.

        Each step includes every record independently with probability q and adds
        :math:`N(0, \sigma^2 C^2 I)` to the sum of clipped (norm <= C) contributions
        (DP-SGD; NoisyGD eq. 2.1 when q = 1). Neighbouring relation: add/remove one.
        Accounted by whichever accountant :meth:`epsilon` is asked for.

        Args:
            noise_multiplier: :math:`\sigma > 0`, noise std / L2 sensitivity
                (clipping norm).
            sample_rate: Poisson sampling probability :math:`q \in (0, 1]`; 1 for
                full-batch NoisyGD.
            steps: integer >= 1.

        Returns:
            self (calls chain). Merged into the previous event when (sigma, q) match.
        """
        self._record(check_positive(noise_multiplier, "noise_multiplier"),
                     check_probability(sample_rate, "sample_rate"), check_pos_int(steps, "steps"))
        return self

    def _record(self, s: float, q: float, t: int) -> None:
        """Append t Gaussian steps (s, q), merged into the last event when equal."""
        last = self._events[-1] if self._events else None
        if isinstance(last, GaussianEvent) and last.noise_multiplier == s and last.sample_rate == q:
            self._events[-1] = GaussianEvent(s, q, last.steps + t)
        else:
            self._events.append(GaussianEvent(s, q, t))

    def add_zcdp(self, rho, count=1) -> "Accountant":
        r"""Record ``count`` mechanisms, each :math:`\rho`-zCDP (add/remove one).

        Accountant: zCDP events compose additively (:math:`\sum \rho`) and are
        answered by ``epsilon(..., accountant="rdp")`` (as the RDP curve
        :math:`\rho\alpha`) or ``"zcdp"``; ``"pld"`` and ``"gdp"`` refuse them. For a
        Gaussian mechanism prefer :meth:`step` with ``sample_rate=1.0``, which every
        accountant handles exactly.

        Args:
            rho: :math:`\rho > 0` of one mechanism.
            count: integer >= 1.

        Returns:
            self. Merged into the previous event when rho matches.
        """
        r = check_positive(rho, "rho")
        c = check_pos_int(count, "count")
        last = self._events[-1] if self._events else None
        if isinstance(last, ZCDPEvent) and last.rho == r:
            self._events[-1] = ZCDPEvent(r, last.count + c)
        else:
            self._events.append(ZCDPEvent(r, c))
        return self

    # -- inspection ----------------------------------------------------------------
    @property
    def history(self) -> tuple:
        """The recorded events, oldest first (immutable :class:`GaussianEvent` /
        :class:`ZCDPEvent` records)."""
        return tuple(self._events)

    @property
    def total_steps(self) -> int:
        """Number of Gaussian steps recorded."""
        return sum(e.steps for e in self._events if isinstance(e, GaussianEvent))

    def __len__(self) -> int:
        return len(self._events)

    def __repr__(self) -> str:
        return f"Accountant(events={list(self._events)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Accountant) and self._events == other._events

    def _grouped_gaussian(self):
        """Gaussian events with equal (sigma, q) merged (composition commutes)."""
        groups: "OrderedDict[tuple, int]" = OrderedDict()
        for e in self._events:
            if isinstance(e, GaussianEvent):
                key = (e.noise_multiplier, e.sample_rate)
                groups[key] = groups.get(key, 0) + e.steps
        return groups

    def _noise_pairs(self) -> int:
        """Box-Muller pairs the history may have drawn, for the truncation charge:
        every key's stream holds at most PAIRS_PER_KEY, and each event (a run of
        equal Gaussian steps, or one zCDP release of a count) is taken to draw
        from a key of its own; the engine's steps share one key (one event)."""
        keys = sum(e.count if isinstance(e, ZCDPEvent) else 1 for e in self._events)
        return max(1, keys) * truncation.PAIRS_PER_KEY

    def _zcdp_events(self):
        return [e for e in self._events if isinstance(e, ZCDPEvent)]

    def dp_event(self):
        """The history as one dp-accounting ``ComposedDpEvent`` (zCDP events as
        ``ZCDpEvent``), for use with any dp-accounting accountant."""
        return self._dp_event(self._grouped_gaussian())

    def _dp_event(self, groups):
        return history_event(import_dp_accounting(), groups, self._zcdp_rho_total())

    def _zcdp_rho_total(self) -> float:
        return sum(e.rho * e.count for e in self._zcdp_events())

    def zcdp_rho(self) -> float:
        r"""Total zCDP :math:`\rho` of the history.

        Gaussian events with q = 1 contribute :math:`T/(2\sigma^2)` (exact), zCDP events
        ``count * rho``. Raises ``ValueError`` when a subsampled (q < 1) event is
        present: the subsampled Gaussian has no useful closed-form zCDP bound.
        """
        rho = 0.0
        for e in self._events:
            if isinstance(e, ZCDPEvent):
                rho += e.rho * e.count
            elif e.sample_rate == 1.0:
                s2 = e.noise_multiplier * e.noise_multiplier      # 0 below ~1e-162
                rho += e.steps / (2.0 * s2) if s2 > 0.0 else math.inf
            else:
                raise ValueError(
                    "zcdp_rho() is defined only without subsampling; the history has a "
                    f"Poisson-subsampled event with sample_rate={e.sample_rate!r}; "
                    "use epsilon(delta, accountant='pld' or 'rdp')"
                )
        return rho

    # -- answers -------------------------------------------------------------------
    def epsilon(
        self,
        delta,
        accountant: str = "pld",
        *,
        value_discretization_interval=DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    ) -> float:
        r"""epsilon of everything recorded so far, at the given delta.

        Accountant: ``"pld"`` (default; dp-accounting's PLD composition, pessimistic,
        Gaussian events only), ``"rdp"`` (dp-accounting RdpAccountant; zCDP events
        as RDP curves :math:`\rho\alpha`), ``"gdp"`` (:math:`\mu^2` adds; CLT for
        q < 1, an approximation; Gaussian events only) or ``"zcdp"`` (CKS conversion
        of :meth:`zcdp_rho`; no subsampled events). Neighbouring relation:
        add/remove one record.

        Args:
            delta: :math:`\delta \in (0, 1)`.
            accountant: ``"pld"``, ``"rdp"``, ``"gdp"`` or ``"zcdp"``.
            value_discretization_interval: PLD grid step (``"pld"`` only).

        Returns:
            epsilon >= 0 (0.0 for an empty history; ``inf`` if unbounded), with
            the sampler's truncated tails charged
            (:func:`~ncdp_fast.privacy.truncation_delta`).
        """
        d = check_delta(delta)
        check_choice(accountant, "accountant", _ACCOUNTANTS)
        interval = check_discretization_interval(value_discretization_interval)
        if not self._events:
            return 0.0
        # Every reported epsilon charges the sampler's truncated tails (privacy.truncation).
        if accountant == "zcdp":
            return zcdp_epsilon(self.zcdp_rho(), d, self._noise_pairs())
        has_zcdp = bool(self._zcdp_events())
        if has_zcdp and accountant in ("pld", "gdp"):
            raise ValueError(
                f"accountant={accountant!r} cannot compose zCDP events: a rho-zCDP guarantee "
                "determines neither a privacy loss distribution nor a GDP mu. Use "
                "accountant='rdp' (zCDP enters as the RDP curve rho*alpha) or 'zcdp', or "
                "record Gaussian steps with step(noise_multiplier=..., sample_rate=1.0)"
            )
        if accountant == "gdp":
            subsampled = [q for (_, q) in self._grouped_gaussian() if q < 1.0]
            if subsampled:
                warn_clt("Accountant.epsilon(accountant='gdp')", min(subsampled))
            mu2 = 0.0
            for (s, q), t in self._grouped_gaussian().items():
                x = 1.0 / (s * s) if s * s > 0.0 else math.inf
                if q == 1.0:
                    mu2 += t * x
                else:
                    if x > 700.0:
                        return math.inf
                    mu2 += q * q * t * math.expm1(x)
            return gdp_epsilon(math.sqrt(mu2), d, self._noise_pairs())
        if accountant == "pld" and beyond_truncation(self._grouped_gaussian(), d,
                                                     self._noise_pairs()):
            return math.inf      # before a PLD that would not fit in memory
        groups = accountable_groups(self._grouped_gaussian())
        if groups is None:
            return math.inf
        of = dpa_epsilon_of(groups, accountant, interval, "the history", self._zcdp_rho_total())
        return epsilon_with_truncation(of, d, self._noise_pairs())

    # -- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-ready description: format, version, neighbouring relation, events."""
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "neighboring_relation": "add_or_remove_one",
            "events": [e.to_dict() for e in self._events],
        }

    def to_json(self, **kwargs) -> str:
        """Serialise to JSON (floats written with full round-trip precision)."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict, *, allow_unbounded: bool = False) -> "Accountant":
        """Rebuild from :meth:`to_dict` output, validating every field.
        ``allow_unbounded`` (the PrivacyEngine's accountant): a history marked
        ``unbounded`` may hold steps with noise multiplier 0."""
        if not isinstance(data, dict):
            raise TypeError(f"data: expected a dict, got {type(data).__name__}")
        if data.get("format") != _FORMAT:
            raise ValueError(f"format: expected {_FORMAT!r}, got {data.get('format')!r}")
        if data.get("version") != _VERSION:
            raise ValueError(f"version: expected {_VERSION}, got {data.get('version')!r}")
        unbounded = check_bool(data.get("unbounded", False), "unbounded")
        if unbounded and not allow_unbounded:
            raise ValueError("unbounded: the history holds a step without noise (no finite "
                             "epsilon); load it into the PrivacyEngine's accountant "
                             "(engine.accountant.load_state_dict), which answers inf")
        rel = data.get("neighboring_relation", "add_or_remove_one")
        if rel != "add_or_remove_one":
            raise ValueError(f"neighboring_relation: expected 'add_or_remove_one', got {rel!r}")
        events = data.get("events")
        if not isinstance(events, list):
            raise TypeError(f"events: expected a list, got {type(events).__name__}")
        acc = cls()
        for i, ev in enumerate(events):
            if not isinstance(ev, dict):
                raise TypeError(f"events[{i}]: expected an object, got {ev!r}")
            kind = ev.get("type")
            if kind == "poisson_gaussian":
                s = ev.get("noise_multiplier")
                if s == 0 and not isinstance(s, bool) and not unbounded:
                    raise ValueError(f"events[{i}].noise_multiplier: 0 (a step without noise) "
                                     "in a history not marked unbounded")
                acc._events.append(
                    GaussianEvent(
                        0.0 if s == 0 and not isinstance(s, bool) else
                        check_positive(s, f"events[{i}].noise_multiplier"),
                        check_probability(ev.get("sample_rate"), f"events[{i}].sample_rate"),
                        check_pos_int(ev.get("steps"), f"events[{i}].steps"),
                    )
                )
            elif kind == "zcdp":
                rho = check_positive(ev.get("rho"), f"events[{i}].rho")
                acc._events.append(
                    ZCDPEvent(rho, check_pos_int(ev.get("count"), f"events[{i}].count"))
                )
            else:
                raise ValueError(
                    f"events[{i}].type: expected 'poisson_gaussian' or 'zcdp', got {kind!r}"
                )
        return acc

    def state_dict(self) -> dict:
        """The history as plain types (:meth:`to_dict`), for a training
        checkpoint: ``load_state_dict`` of it in a new process continues the
        accounting where it stopped. Holds no key and no data."""
        return self.to_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Replace the history by the one of :meth:`state_dict` (every field
        validated first: nothing changes when it is refused)."""
        self._events = list(type(self).from_dict(state_dict)._events)

    @classmethod
    def from_json(cls, s: str) -> "Accountant":
        """Rebuild an accountant from :meth:`to_json` output."""
        if not isinstance(s, (str, bytes, bytearray)):
            raise TypeError(f"s: expected a JSON string, got {type(s).__name__}")
        try:
            data = json.loads(s)
        except json.JSONDecodeError as e:
            raise ValueError(f"s: expected the JSON of Accountant.to_json, got text that does "
                             f"not parse ({e})") from None
        return cls.from_dict(data)
