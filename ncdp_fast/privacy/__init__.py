r"""Privacy accounting and noise calibration for ncdp_fast.

Built on Google's dp-accounting (PLD and RDP accountants), imported lazily by the
functions that need it (``pip install dp-accounting``); the closed forms it lacks
(zCDP conversions, exact mu-GDP tradeoff, the GDP central-limit theorem,
NeuroMixGDP's Theorem 3.1) are written here. Needs neither torch nor Opacus.

Neighbouring relation everywhere: add/remove one record (dp-accounting's
``ADD_OR_REMOVE_ONE``, Opacus's convention for Poisson subsampling).

Which function for which paper:

* NoisyGD (``000_82fe6240ae4b04be``, zCDP): :func:`gaussian_zcdp`,
  :func:`noisygd_sigma`, :func:`zcdp_to_dp`, :func:`dp_to_zcdp`.
* NeuroMixGDP (``002_1ce43e1ce6039d97``, GDP + CLT): :func:`dp_to_gdp`,
  :func:`gdp_to_dp`, :func:`poisson_gdp_mu`, :func:`neuromix_noise`,
  :func:`optimal_mixup_degree`; with hierarchical sampling :func:`hs_epsilon`,
  :func:`hs_noise_multiplier`.
* DP-SGD / any Poisson-subsampled Gaussian: :func:`epsilon_poisson_gaussian`,
  :func:`calibrate_noise_multiplier`, :class:`Accountant`; the calibration search
  itself, for any accountant whose epsilon falls with sigma: :func:`search_noise_multiplier`.

Every epsilon reported and every sigma calibrated here (and by the trainers,
the release report and the torch engine) charges the sampler's truncated
Gaussian tails, :func:`truncation_delta` (:mod:`ncdp_fast.privacy.truncation`);
the pure conversions (:func:`zcdp_to_dp`, :func:`gdp_to_dp`, ...) do not.

See ``docs/privacy.md``.
"""

from .accountant import Accountant, GaussianEvent, ZCDPEvent
from .gdp import clt_noise_multiplier, dp_to_gdp, gdp_delta, gdp_to_dp, poisson_gdp_mu
from .hierarchical import hs_epsilon, hs_noise_multiplier
from .neuromix import NU_STAR_OVER_MU, NeuroMixNoise, neuromix_noise, optimal_mixup_degree
from .subsampled import (
    DEFAULT_EPSILON_RTOL,
    DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    calibrate_noise_multiplier,
    epsilon_poisson_gaussian,
    search_noise_multiplier,
)
from .truncation import PAIRS_PER_KEY, epsilon_with_truncation, ideal_delta, truncation_delta
from .zcdp import dp_to_zcdp, gaussian_zcdp, noisygd_sigma, zcdp_to_dp

__all__ = [
    # zCDP (NoisyGD)
    "zcdp_to_dp",
    "dp_to_zcdp",
    "gaussian_zcdp",
    "noisygd_sigma",
    # GDP (NeuroMixGDP)
    "gdp_delta",
    "gdp_to_dp",
    "dp_to_gdp",
    "poisson_gdp_mu",
    "clt_noise_multiplier",
    # Poisson-subsampled Gaussian
    "epsilon_poisson_gaussian",
    "calibrate_noise_multiplier",
    "search_noise_multiplier",
    "DEFAULT_VALUE_DISCRETIZATION_INTERVAL",
    "DEFAULT_EPSILON_RTOL",
    # NeuroMixGDP
    "neuromix_noise",
    "NeuroMixNoise",
    "optimal_mixup_degree",
    "NU_STAR_OVER_MU",
    # NeuroMixGDP with hierarchical sampling
    "hs_epsilon",
    "hs_noise_multiplier",
    # The sampler's truncated tails, charged by every function above
    "truncation_delta",
    "ideal_delta",
    "epsilon_with_truncation",
    "PAIRS_PER_KEY",
    # Accountant
    "Accountant",
    "GaussianEvent",
    "ZCDPEvent",
]
