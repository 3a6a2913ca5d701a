"""Adaptive clipping: the clipping bound C follows a private quantile of the per-sample norms (Andrew, Thakkar, McMahan
and Ramaswamy 2021, "Differentially Private Learning with Adaptive Clipping", Algorithm 1 and Theorem 1).

Each logical step clips at ``C_t`` and also releases the centred noisy count of unclipped examples

    ``b~_t = (sum_i (1[n_i <= C_t] - 1/2) + N(0, sigma_b^2)) / (q N) + 1/2``,

then ``C_{t+1} = C_t exp(-eta (b~_t - gamma))``, clamped to ``[min_clipbound, max_clipbound]``. The sum's noise
std is ``sigma_sum C_t`` with ``sigma_sum = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)`` (needs ``sigma_b > sigma / 2``), so
the step costs one Gaussian step at ``noise_multiplier = sigma`` and the accountant records that event. The
argument, and how it differs from Opacus's ``AdaClipDPOptimizer``: docs/adaptive_clipping.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: ``sigma_b = expected batch size / 20``, the setting of Andrew et al. 2021's experiments (the estimated fraction then
#: has std 0.05).
DEFAULT_COUNT_NOISE_FRACTION = 1 / 20


def sum_noise_multiplier(noise_multiplier: float, unclipped_num_std: float) -> float:
    """``sigma_sum = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)``, the noise multiplier of the clipped sum that makes the pair
    (sum, centred count) cost one Gaussian step at ``sigma`` (Andrew et al. 2021, Theorem 1); 0 when ``sigma = 0``.

    Raises:
        ValueError: ``unclipped_num_std <= noise_multiplier / 2`` with ``noise_multiplier > 0`` (the count alone
            would cost more than the whole step).
    """
    if noise_multiplier == 0:
        return 0.0
    if not unclipped_num_std > noise_multiplier / 2:
        raise ValueError(
            f"adaptive clipping needs unclipped_num_std > noise_multiplier / 2 = {noise_multiplier / 2:.4g}, got "
            f"{unclipped_num_std:.4g}: raise unclipped_num_std (Andrew et al. 2021 use the expected batch size / 20) "
            "or the expected batch size"
        )
    return (noise_multiplier**-2 - (2 * unclipped_num_std) ** -2) ** -0.5


def validate_adaptive_clipping(
    target_unclipped_quantile: float | None,
    clipbound_learning_rate: float,
    min_clipbound: float | None,
    max_clipbound: float | None,
    unclipped_num_std: float | None,
) -> None:
    """Raise ``ValueError`` (naming the option) unless the adaptive-clipping options are valid: the quantile in
    ``(0, 1)``, a positive learning rate, ``0 < min_clipbound < max_clipbound``, ``unclipped_num_std >= 0``; the
    clamps and ``unclipped_num_std`` given without a quantile are refused (they would be ignored; the learning rate
    has a default, so it cannot tell)."""
    from lightning_dp.config.errors import checking

    if target_unclipped_quantile is None:
        given = [
            name
            for name, value in (
                ("min_clipbound", min_clipbound),
                ("max_clipbound", max_clipbound),
                ("unclipped_num_std", unclipped_num_std),
            )
            if value is not None
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)} set without target_unclipped_quantile: adaptive clipping is off; set "
                "target_unclipped_quantile (e.g. 0.5) to turn it on, or remove them"
            )
        return
    with checking("target_unclipped_quantile"):
        if not 0 < target_unclipped_quantile < 1:
            raise ValueError(f"target_unclipped_quantile must be in (0, 1), got {target_unclipped_quantile}")
    with checking("clipbound_learning_rate"):
        if not clipbound_learning_rate > 0:
            raise ValueError(f"clipbound_learning_rate must be > 0, got {clipbound_learning_rate}")
    for name, value in (("min_clipbound", min_clipbound), ("max_clipbound", max_clipbound)):
        with checking(name):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
    if min_clipbound is not None and max_clipbound is not None and not min_clipbound < max_clipbound:
        raise ValueError(f"min_clipbound={min_clipbound} must be below max_clipbound={max_clipbound}")
    with checking("unclipped_num_std"):
        if unclipped_num_std is not None and not unclipped_num_std >= 0:
            raise ValueError(f"unclipped_num_std must be >= 0, got {unclipped_num_std}")


class AdaptiveClipping:
    """The clipping bound of a run with adaptive clipping, and the noisy count that moves it (module docstring).

    Args:
        initial_bound: ``C_0`` (the run's ``max_grad_norm``).
        target_unclipped_quantile: ``gamma`` in (0, 1), the fraction of examples to leave unclipped.
        clipbound_learning_rate: ``eta > 0`` of the geometric update.
        unclipped_num_std: ``sigma_b >= 0``, the std of the count's noise (in examples).
        expected_batch_size: ``q N`` of one logical step.
        min_clipbound, max_clipbound: clamps of ``C`` (``None``: none).

    Attributes:
        bound: the current ``C_t`` (a float: a released value).
    """

    def __init__(
        self,
        *,
        initial_bound: float,
        target_unclipped_quantile: float,
        clipbound_learning_rate: float,
        unclipped_num_std: float,
        expected_batch_size: float,
        min_clipbound: float | None = None,
        max_clipbound: float | None = None,
    ) -> None:
        self.bound = float(initial_bound)
        self.target_unclipped_quantile = float(target_unclipped_quantile)
        self.clipbound_learning_rate = float(clipbound_learning_rate)
        self.unclipped_num_std = float(unclipped_num_std)
        self.expected_batch_size = float(expected_batch_size)
        self.min_clipbound = min_clipbound
        self.max_clipbound = max_clipbound
        #: ``sum_i (1[n_i <= C_t] - 1/2)`` over this step's micro-batches so far, on this rank (a 0-dim float64
        #: tensor on the norms' device; ``None`` before the first micro-batch of the step).
        self.centred_count: torch.Tensor | None = None

    def count(self, norms: torch.Tensor) -> None:
        """Add a micro-batch's per-sample norms ``[B]`` (before clipping: those its clip factors at :attr:`bound` came
        from) to this step's centred count; a non-finite norm counts as clipped. No host sync."""
        centred = (norms <= self.bound).sum(dtype=torch.float64) - 0.5 * norms.numel()
        self.centred_count = centred if self.centred_count is None else self.centred_count + centred

    def discard_count(self) -> None:
        """Forget the count of a step that ended without :meth:`update` (interrupted), so that the next step's
        release counts only its own Poisson sample."""
        self.centred_count = None

    def count_tensor(self, device: torch.device) -> torch.Tensor:
        """This step's centred count as a 0-dim float64 tensor on ``device`` (zeros when no example was seen on this
        rank), kept as :attr:`centred_count`, so that a SUM all-reduce of it in place reaches :meth:`update`."""
        if self.centred_count is None:
            self.centred_count = torch.zeros((), dtype=torch.float64, device=device)
        return self.centred_count

    def update(self, noise: torch.Tensor) -> float:
        """Release the count with ``noise`` (a draw of ``N(0, sigma_b^2)``, 0-dim), move the bound and return it: one
        host sync per step, a read of the released (noised) count only.

        On several processes the count must first be all-reduced over the ranks and ``noise`` be the same draw
        everywhere.

        Raises:
            FloatingPointError: the new bound is not a positive finite number (computed from released values only).
        """
        count = self.centred_count if self.centred_count is not None else torch.zeros((), dtype=torch.float64)
        # the one host read of adaptive clipping (the bound is a host number): the released noisy count, read once
        fraction = float(count + noise.to(count.device, torch.float64)) / self.expected_batch_size + 0.5
        exponent = -self.clipbound_learning_rate * (fraction - self.target_unclipped_quantile)
        bound = self.bound * math.exp(exponent) if exponent < 700 else math.inf
        if not 0 < bound < math.inf:
            raise FloatingPointError(
                f"adaptive clipping moved the bound from {self.bound:.4g} to {bound}: lower clipbound_learning_rate "
                "or unclipped_num_std, or set min_clipbound / max_clipbound"
            )
        if self.min_clipbound is not None:
            bound = max(bound, self.min_clipbound)
        if self.max_clipbound is not None:
            bound = min(bound, self.max_clipbound)
        self.bound, self.centred_count = bound, None
        return bound

    def describe(self) -> dict[str, float | None]:
        """The options (fixed for the run; the current bound is :attr:`bound`), for summaries."""
        return {
            "target_unclipped_quantile": self.target_unclipped_quantile,
            "clipbound_learning_rate": self.clipbound_learning_rate,
            "unclipped_num_std": self.unclipped_num_std,
            "min_clipbound": self.min_clipbound,
            "max_clipbound": self.max_clipbound,
        }

    def state_dict(self) -> dict[str, Any]:
        """The current bound (a function of released values only; the count in progress is not kept: checkpoints
        are written between steps)."""
        return {"bound": self.bound}

    def restore(self, bound: float) -> None:
        """Continue from a checkpoint's bound (:func:`restored_bound` of a :meth:`state_dict`); no count in
        progress."""
        self.bound, self.centred_count = float(bound), None


def restored_bound(state: Any) -> float:
    """The bound in an :meth:`AdaptiveClipping.state_dict` read back from a checkpoint (for
    :meth:`AdaptiveClipping.restore`).

    Raises:
        ValueError: not a dict with a positive number under ``"bound"``.
    """
    bound = state.get("bound") if isinstance(state, dict) else None
    if not isinstance(bound, int | float) or not bound > 0:
        raise ValueError(f"the checkpoint's adaptive-clipping state has no positive bound: {state!r}")
    return float(bound)
