"""The accountant a PrivacyEngine exposes as ``privacy_engine.accountant``:
ncdp_fast's :class:`~ncdp_fast.privacy.Accountant` with the calls Opacus user
code makes on its accountant."""
from __future__ import annotations

import math

from .. import privacy
from .._validate import check_delta, check_pos_int, check_probability

__all__ = ["EngineAccountant"]


def dp_accounting_name(kind: str) -> str:
    # "prv" (Opacus's default: privacy random variables composed by FFT) and
    # "pld" compose the same privacy-loss distribution numerically; both are
    # computed by dp-accounting's PLD accountant, a pessimistic upper bound.
    return "pld" if kind == "prv" else kind


class EngineAccountant(privacy.Accountant):
    """The engine's record of its private steps, one Poisson-subsampled Gaussian
    event per run of steps at equal (noise_multiplier, sample_rate).

    Opacus's accountant calls: :meth:`get_epsilon` (delta), ``len()`` (the
    number of history entries, as Opacus), :attr:`history` (a list of
    ``(noise_multiplier, sample_rate, num_steps)`` tuples), :meth:`mechanism`,
    ``step``, ``state_dict`` / ``load_state_dict``.  ``unbounded`` is set once a
    step ran with noise_multiplier 0: such a step has no finite epsilon, and
    every later answer is inf; it is in the history (noise_multiplier 0.0) and
    in the state dict, so that an accountant loaded from it (Opacus's
    ``accountant.load_state_dict`` of a checkpoint) answers inf too.
    Neighbouring relation: add/remove one record.
    """

    def __init__(self, mechanism: str = "prv"):
        super().__init__()
        self._mechanism = mechanism
        self.unbounded = False

    def mechanism(self) -> str:
        """The engine's ``accountant=`` ("prv", "rdp", "gdp" or "pld")."""
        return self._mechanism

    @property
    def history(self) -> list:
        """The recorded steps, oldest first: a new list of
        ``(noise_multiplier, sample_rate, num_steps)`` named tuples (Opacus's
        format; changing the list changes nothing recorded)."""
        return list(super().history)

    def step(self, *, noise_multiplier, sample_rate=1.0, steps=1) -> "EngineAccountant":
        """As :meth:`Accountant.step`; a noise multiplier of exactly 0 (a noise
        scheduler that reached it) is recorded as such and makes every later
        answer inf (``unbounded``)."""
        if isinstance(noise_multiplier, (int, float)) and noise_multiplier == 0:
            self._record(0.0, check_probability(sample_rate, "sample_rate"),
                         check_pos_int(steps, "steps"))
            self.unbounded = True
            return self
        super().step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, steps=steps)
        return self

    def epsilon(self, *args, **kwargs) -> float:
        """As :meth:`Accountant.epsilon`; inf once a step had no noise."""
        if self.unbounded:
            return math.inf
        return super().epsilon(*args, **kwargs)

    def state_dict(self) -> dict:
        """The history as plain types, the steps without noise included (and
        ``unbounded``)."""
        state = super().state_dict()
        state["unbounded"] = bool(self.unbounded)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Replace the history by the one of :meth:`state_dict` (validated
        first: nothing changes when it is refused); steps without noise are
        accepted only in a history marked ``unbounded``, which sets it."""
        parsed = privacy.Accountant.from_dict(state_dict, allow_unbounded=True)
        self._events = list(parsed._events)
        self.unbounded = bool(state_dict.get("unbounded", False))
        # The steps of a run resumed Opacus-style: its private optimizer checks
        # that its noise stream was restored with them (DPOptimizer.step).
        self.loaded_steps = self.total_steps

    def get_epsilon(self, delta) -> float:
        """epsilon at ``delta`` of the steps recorded (0 before the first; inf
        once a step had noise_multiplier 0), under the engine's accountant."""
        d = check_delta(delta)
        if self.unbounded:
            return float("inf")
        if len(self) == 0:
            return 0.0
        return self.epsilon(d, dp_accounting_name(self._mechanism))
