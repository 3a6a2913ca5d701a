"""The kinds of correlated noise a run can ask for (``noise_correlation``), each one's accountant and defaults: plain
constants, importable without torch (the command line reads them for its choices)."""

from __future__ import annotations

#: The ``noise_correlation`` values: ``None`` (independent noise, DP-SGD), ``"banded"`` (banded matrix factorization
#: under cyclic Poisson sampling) or ``"blt"`` (buffered-linear-Toeplitz matrix factorization under cyclic sampling
#: over ``floor(1 / q)`` groups), docs/design.md section 5.1.
NOISE_CORRELATIONS = (None, "banded", "blt")
#: The accountant of ``noise_correlation='banded'`` (:class:`~lightning_dp.accounting.banded_mf.BandedMFAccountant`).
BANDED_MF_ACCOUNTANT = "banded-mf"
#: The accountant of ``noise_correlation='blt'`` (:class:`~lightning_dp.accounting.blt_minsep.BLTMinSepAccountant`).
BLT_ACCOUNTANT = "blt-minsep"
#: Each correlated kind's accountant: its default and the only one accepted.
CORRELATION_ACCOUNTANTS = {"banded": BANDED_MF_ACCOUNTANT, "blt": BLT_ACCOUNTANT}
#: ``correlation_buffers`` of ``noise_correlation='blt'`` when not given.
DEFAULT_BLT_BUFFERS = 4
