"""Checks of :class:`~lightning_dp.config.PrivacyConfig` that are about a combination of options: which engines,
mechanisms and accountants adaptive clipping, randomized clipping and correlated noise (``noise_correlation``) may
be combined with. Each refusal is one line saying what to change (docs/validation.md lists them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from lightning_dp.config.errors import checking
from lightning_dp.optim.adaptive_clipping import sum_noise_multiplier

if TYPE_CHECKING:
    from lightning_dp.config.privacy_config import PrivacyConfig

#: The ``noise_correlation`` values: ``None`` (independent noise, DP-SGD) or ``"banded"`` (banded matrix
#: factorization under cyclic Poisson sampling, docs/design.md section 5.1).
NOISE_CORRELATIONS = (None, "banded")
#: The accountant of ``noise_correlation='banded'`` (:class:`~lightning_dp.accounting.banded_mf.BandedMFAccountant`).
BANDED_MF_ACCOUNTANT = "banded-mf"


def check_randomized_and_adaptive(config: PrivacyConfig) -> None:
    """Randomized clipping needs Gaussian noise and the ``rc`` accountant; adaptive clipping needs Gaussian noise and
    an exact engine, a starting bound within its clamps, and count noise that leaves the sum a positive share.

    Raises:
        ValueError: one of these combinations is broken.
    """
    if config.randomized_clipping and (config.noise_name != "gaussian" or config.accountant not in (None, "rc")):
        raise ValueError(
            f"clipping={config.clipping!r} clips by a random norm estimate, which only the randomized-clipping "
            "accountant accounts for: use noise='gaussian' with accountant='rc' (the default), or clipping='auto' "
            "or an exact engine (ghost, mixed, fgc, flat)"
        )
    if not config.adaptive_clipping:
        return
    if config.noise_name != "gaussian" or config.randomized_clipping:
        raise ValueError(
            "adaptive clipping (target_unclipped_quantile) needs noise='gaussian' and an exact clipping engine "
            f"(flat, ghost, fgc, mixed), got noise={config.noise_name!r}, clipping={config.clipping!r}"
        )
    low, high = config.min_clipbound or 0.0, config.max_clipbound or float("inf")
    # one bound here: a list needs clipping_groups (validate_clipping_groups), which adaptive clipping refuses
    if not low <= cast(float, config.max_grad_norm) <= high:
        with checking("max_grad_norm"):
            raise ValueError(
                f"max_grad_norm={config.max_grad_norm} (the starting bound of adaptive clipping) lies outside "
                f"[min_clipbound, max_clipbound] = [{low}, {high}]"
            )
    if config.noise_multiplier is not None and config.unclipped_num_std is not None:
        with checking("unclipped_num_std"):
            sum_noise_multiplier(config.noise_multiplier, config.unclipped_num_std)


def check_noise_correlation(config: PrivacyConfig) -> None:
    """``noise_correlation='banded'`` needs a band ``b >= 1``, Gaussian noise, the ``banded-mf`` accountant, Poisson
    sampling and an exact clipping engine at a fixed bound; ``banded-mf`` and ``correlation_band`` need it.

    Why each refusal (docs/design.md section 5.1): the amplification theorem is about Gaussian noise under cyclic
    Poisson sampling (the sampler the run installs), so another mechanism, accountant or sampler has no bound; a
    randomized engine's random clipping bound and adaptive clipping's extra count release are other mechanisms than
    the one the ``banded-mf`` accountant bounds.

    Raises:
        ValueError: one of these combinations is broken.
    """
    correlation, band = config.noise_correlation, config.correlation_band
    if correlation not in NOISE_CORRELATIONS:
        with checking("noise_correlation"):
            raise ValueError(f"noise_correlation must be None or 'banded', got {correlation!r}")
    if correlation is None:
        if band is not None:
            with checking("correlation_band"):
                raise ValueError(f"correlation_band={band} applies to noise_correlation='banded'; set that too")
        if config.accountant == BANDED_MF_ACCOUNTANT:
            with checking("accountant"):
                raise ValueError(
                    "accountant='banded-mf' accounts for noise_correlation='banded' only; set noise_correlation="
                    "'banded' with a correlation_band, or use the mechanism's default accountant"
                )
        return
    if isinstance(band, bool) or not isinstance(band, int) or band < 1:
        with checking("correlation_band"):
            raise ValueError(
                f"noise_correlation='banded' needs correlation_band, an integer b >= 1 (1 is DP-SGD), got {band!r}"
            )
    if config.noise_name != "gaussian":
        raise ValueError(
            f"noise_correlation='banded' correlates Gaussian noise: use noise='gaussian', not {config.noise_name!r}"
        )
    if config.accountant not in (None, BANDED_MF_ACCOUNTANT):
        with checking("accountant"):
            raise ValueError(
                f"noise_correlation='banded' is accounted by accountant='banded-mf' only, not {config.accountant!r}"
            )
    if not config.poisson_sampling:
        raise ValueError("noise_correlation='banded' samples by cyclic Poisson sampling: keep poisson_sampling=True")
    if config.randomized_clipping:
        raise ValueError(
            f"noise_correlation='banded' needs an exact clipping engine, not clipping={config.clipping!r}; use "
            "clipping='auto'"
        )
    if config.adaptive_clipping:
        raise ValueError(
            "noise_correlation='banded' with adaptive clipping is not supported (its count release is not part of the "
            "banded-mf accountant's mechanism): remove target_unclipped_quantile"
        )
