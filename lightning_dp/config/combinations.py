"""Checks of :class:`~lightning_dp.config.PrivacyConfig` that are about a combination of options: which engines,
mechanisms and accountants adaptive clipping, randomized clipping and correlated noise (``noise_correlation``) may
be combined with, and which runs ``exact_resume`` can continue. Each refusal is one line saying what to change
(docs/validation.md lists them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from lightning_dp.accounting import ACCOUNTANTS
from lightning_dp.clipping.groups import check_grouped_clipping
from lightning_dp.config.errors import checking
from lightning_dp.correlated_noise.kinds import CORRELATION_ACCOUNTANTS, NOISE_CORRELATIONS
from lightning_dp.mechanisms.base import NoiseMechanism, mechanism_class
from lightning_dp.optim.adaptive_clipping import sum_noise_multiplier

if TYPE_CHECKING:
    from lightning_dp.config.privacy_config import PrivacyConfig


def check_noise_given(config: PrivacyConfig) -> None:
    """Exactly one of ``target_epsilon`` or the noise (``noise_multiplier``, ``noise_params`` or a mechanism instance),
    and registered names for ``noise`` and ``accountant``.

    Raises:
        ValueError: none or several of them; an unknown mechanism or accountant name (listing the valid ones).
    """
    fixed_noise = [
        config.noise_multiplier is not None,
        bool(config.noise_params),
        isinstance(config.noise, NoiseMechanism),
    ]
    if (config.target_epsilon is None) == (not any(fixed_noise)) or sum(fixed_noise) > 1:
        raise ValueError(
            "Give exactly one of target_epsilon (the noise is calibrated for it) or the noise itself "
            "(noise_multiplier for Gaussian, noise_params for other mechanisms, or a NoiseMechanism instance)"
        )
    if not isinstance(config.noise, NoiseMechanism):
        with checking("noise"):
            mechanism_class(config.noise)  # an unknown name fails here, listing the valid ones
    if config.accountant is not None:
        with checking("accountant"):
            ACCOUNTANTS.get(config.accountant)  # an unknown name fails here, listing the valid ones


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
    """``noise_correlation='banded'`` needs a band ``b >= 1``, ``'blt'`` takes ``correlation_buffers`` ``d >= 1``
    (default :data:`~lightning_dp.correlated_noise.kinds.DEFAULT_BLT_BUFFERS`); both need Gaussian noise, their own
    accountant (``banded-mf``, ``blt-minsep``), Poisson sampling and an exact clipping engine at a fixed bound; those
    accountants and options need their kind.

    Why each refusal (docs/design.md section 5.1): the accountants bound Gaussian noise under the cyclic sampler the
    run installs, so another mechanism, accountant or sampler has no bound; a randomized engine's random clipping bound
    and adaptive clipping's extra count release are other mechanisms than the one the accountants bound.

    Raises:
        ValueError: one of these combinations is broken.
    """
    correlation, band, buffers = config.noise_correlation, config.correlation_band, config.correlation_buffers
    if correlation not in NOISE_CORRELATIONS:
        with checking("noise_correlation"):
            raise ValueError(f"noise_correlation must be None, 'banded' or 'blt', got {correlation!r}")
    for option, value, kind in (("correlation_band", band, "banded"), ("correlation_buffers", buffers, "blt")):
        if value is not None and correlation != kind:
            with checking(option):
                change = "set that too" if correlation is None else f"not {correlation!r}: remove it"
                raise ValueError(f"{option}={value} applies to noise_correlation={kind!r}; {change}")
    for kind, accountant in CORRELATION_ACCOUNTANTS.items():
        if config.accountant == accountant and correlation != kind:
            with checking("accountant"):
                raise ValueError(
                    f"accountant={accountant!r} accounts for noise_correlation={kind!r} only; set noise_correlation="
                    f"{kind!r}, or use the mechanism's default accountant"
                )
    if correlation is None:
        return
    if correlation == "banded" and (isinstance(band, bool) or not isinstance(band, int) or band < 1):
        with checking("correlation_band"):
            raise ValueError(
                f"noise_correlation='banded' needs correlation_band, an integer b >= 1 (1 is DP-SGD), got {band!r}"
            )
    if buffers is not None and (isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 1):
        with checking("correlation_buffers"):
            raise ValueError(f"correlation_buffers must be an integer d >= 1 (the BLT's buffers), got {buffers!r}")
    if config.noise_name != "gaussian":
        raise ValueError(
            f"noise_correlation={correlation!r} correlates Gaussian noise: use noise='gaussian', not "
            f"{config.noise_name!r}"
        )
    accountant = CORRELATION_ACCOUNTANTS[correlation]
    if config.accountant not in (None, accountant):
        with checking("accountant"):
            raise ValueError(
                f"noise_correlation={correlation!r} is accounted by accountant={accountant!r} only, not "
                f"{config.accountant!r}"
            )
    if not config.poisson_sampling:
        raise ValueError(
            f"noise_correlation={correlation!r} samples by cyclic Poisson sampling: keep poisson_sampling=True"
        )
    if config.randomized_clipping:
        raise ValueError(
            f"noise_correlation={correlation!r} needs an exact clipping engine, not clipping={config.clipping!r}; use "
            "clipping='auto'"
        )
    if config.adaptive_clipping:
        raise ValueError(
            f"noise_correlation={correlation!r} with adaptive clipping is not supported (its count release is not "
            f"part of the {accountant} accountant's mechanism): remove target_unclipped_quantile"
        )


def check_clipping_groups(config: PrivacyConfig) -> None:
    """``clipping_groups`` with the mechanism's clipping norm, the engine and adaptive clipping
    (:func:`~lightning_dp.clipping.groups.check_grouped_clipping`).

    Raises:
        ValueError: a combination :func:`~lightning_dp.clipping.groups.check_grouped_clipping` refuses.
    """
    if config.clipping_groups is not None:
        with checking("clipping_groups"):
            check_grouped_clipping(
                norm=config.clip_norm,
                engine=config.clipping,
                randomized=config.randomized_clipping,
                adaptive=config.adaptive_clipping,
            )


def check_exact_resume(config: PrivacyConfig) -> None:
    """``exact_resume=True`` continues streams a checkpoint keeps: not those of ``secure_mode`` (fresh OS entropy at
    every request), the users' subsets of ``privacy_unit='user'`` (drawn by a count the loader keeps), the batches of
    ``poisson_sampling=False`` (the user's sampler) or the projections of ``hutch``/``hutchpp`` (one stream per rank,
    drawn by its batch size, of which a checkpoint keeps rank 0's).

    Raises:
        ValueError: ``exact_resume=True`` with any of them.
    """
    if not config.exact_resume:
        return
    why = {
        "secure_mode=True draws fresh OS entropy": config.secure_mode,
        "privacy_unit='user' draws subsets": config.privacy_unit == "user",
        "poisson_sampling=False takes batches from your sampler": not config.poisson_sampling,
        f"clipping={config.clipping!r} draws projections per rank": config.randomized_clipping,
    }
    for reason, applies in why.items():
        if applies:
            raise ValueError(
                f"exact_resume=True cannot continue this run ({reason} that a checkpoint does not keep): remove "
                "exact_resume (a resume then draws fresh streams)"
            )
