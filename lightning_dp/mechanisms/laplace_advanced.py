"""The "advanced" Laplace mechanism: l2 clipping with the literature review's noise scale (section 4).

Noise and clipping are those of LAP2 (i.i.d. ``Lap(0, b)`` on the l2-clipped sum); what differs is how ``b`` is
chosen: literature review 4.4 sets ``b = (C / eps_0) sqrt(2 ln(1.25 / delta_0))`` with ``eps_0`` from advanced
composition (4.3) and ``delta_0 = delta / (2T)`` (``calibrate(noise="laplace-advanced", ...)``). That formula is
the Gaussian mechanism's, transplanted to Laplace noise; the guarantee actually reported defaults to the sound
LAP2 accountant (``"lap2"``), with ``"advanced"`` (the review's composition) available for comparison.
"""

from __future__ import annotations

from lightning_dp.mechanisms.base import register_mechanism
from lightning_dp.mechanisms.lap2 import Lap2Mechanism


@register_mechanism
class LaplaceAdvancedMechanism(Lap2Mechanism):
    """``Lap(0, noise_scale)`` per coordinate on the l2-clipped sum, scale from literature review 4.4.

    Args:
        noise_scale: Laplace scale ``b > 0`` in gradient units.
        max_grad_norm: l2 clipping bound ``C > 0``.

    Raises:
        ValueError: non-positive or non-finite ``noise_scale`` or ``max_grad_norm``.
    """

    name = "laplace-advanced"
    default_accountant = "lap2"
