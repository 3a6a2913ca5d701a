"""Clipping engines: how a parameter's per-sample norm contribution is computed from its terms.

- ``base``: :class:`ClippingEngine`, the :data:`ENGINES` registry, ``register_engine``, ``auto_engine`` and the
  engine factory;
- ``flat``: ``flat``, materialised per-sample gradients (the only engine with l1 clipping);
- ``ghost``: ``ghost``, Gram-matrix norms without per-sample gradients (Li et al. 2022);
- ``fgc``: ``fgc``, one parameter at a time (Lee & Kifer 2021);
- ``mixed``: ``mixed``, per parameter the cheaper of ghost and materialised norms (Bu et al. 2023);
- ``projection``: products with a per-sample gradient through its factors, the primitive of the randomized engines;
- ``hutch``: ``hutch``, Hutchinson's randomized norm estimate, and the base of the randomized engines;
- ``hutchpp``: ``hutchpp``, the Hutch++ randomized norm estimate.

Importing this package registers the built-in engines (in the order ``ghost``, ``fgc``, ``flat``, ``hutch``,
``hutchpp``, ``mixed``: ``fgc`` imports ``ghost``).
"""

from lightning_dp.clipping.engines import fgc, flat, ghost, hutch, hutchpp, mixed  # noqa: F401 (registration)
