"""Clipping engines (docs/design.md section 4.3): ``base`` (:class:`ClippingEngine`, :data:`ENGINES`, the factory),
``flat``, ``ghost``, ``fgc``, ``mixed``, ``projection`` (the randomized engines' primitive), ``hutch``, ``hutchpp``.
Importing the package registers the built-in engines.
"""

from lightning_dp.clipping.engines import fgc, flat, ghost, hutch, hutchpp, mixed  # noqa: F401 (registration)
