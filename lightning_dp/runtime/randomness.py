"""The dedicated random streams of a DP run: noise (one generator per device) and Poisson sampling.

Never the global RNG. Streams are derived from one base seed with ``numpy.random.SeedSequence`` (independent,
well-mixed streams per purpose, device and restart), and NOTHING about them is written to checkpoints: a released
checkpoint that contained the seed or generator states would let anyone re-create every noise draw and the batch
composition, and subtract the noise. A resumed run instead calls :meth:`DPRandomness.restart` with the number of
steps already taken, so it never replays noise of the first run (with ``seed=None`` it draws fresh OS entropy).

On several processes (:mod:`lightning_dp.runtime.distributed`) every rank adopts rank 0's base seed with
:meth:`DPRandomness.share`: the noise streams are then identical on all ranks (noise is drawn once per step, the
same draw everywhere), while each rank's Poisson-sampling stream is derived with its rank, so the ranks' shards are
sampled independently. Rank 0 keeps the single-process streams.

With ``secure=True`` (``secure_mode``) no seed is accepted, and every request for a noise or projection generator
reseeds it with 64 fresh bits from the OS CSPRNG (``os.urandom``), so each draw (one per parameter per step) starts
from fresh OS entropy and nothing links draws of different steps. torch's generators themselves (MT19937 on CPU,
Philox on CUDA) are not cryptographic; the seeds are. The Poisson-sampling stream is seeded from OS entropy at the
start and at each restart. Secure mode is single-process: ranks cannot share fresh OS entropy per draw.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import torch


def derive_seed(base: int, *keys: int | str) -> int:
    """A 63-bit seed for the stream named by ``keys``, derived from ``base`` with ``SeedSequence``."""
    entropy = [int(base) & (2**64 - 1)] + [zlib.crc32(k.encode()) if isinstance(k, str) else int(k) for k in keys]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> 1)


def indexed_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: an accelerator named without one (``"cuda"``) is the current CUDA device, or index
    0 of another type; the CPU stays ``cpu``. One device has one name, so that a generator or a Lightning accelerator
    keyed or selected by it is the same for ``"cuda"`` and ``"cuda:0"``."""
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        return torch.device(device.type, torch.cuda.current_device() if device.type == "cuda" else 0)
    return device


class DPRandomness:
    """Noise and sampling generators derived from one seed.

    Args:
        seed: base seed for reproducible experiments; ``None`` (recommended for real runs) draws 64 bits from
            ``os.urandom``. Either way the seed is never checkpointed.
        secure: reseed the noise and projection generators from ``os.urandom`` at every request (module docstring).

    Raises:
        ValueError: a ``seed`` with ``secure=True``.
    """

    def __init__(self, seed: int | None = None, *, secure: bool = False) -> None:
        if secure and seed is not None:
            raise ValueError(f"secure randomness draws from the OS CSPRNG and takes no seed, got seed={seed}")
        self.secure = secure
        self._user_seed = seed
        self._base = int(seed) if seed is not None else int.from_bytes(os.urandom(8), "little")
        self._restart = 0
        self._rank: int | None = None
        self._generators: dict[tuple[str, torch.device, tuple[int, ...]], torch.Generator] = {}
        self.sampling = torch.Generator()
        self._seed_sampling()

    @property
    def base_seed(self) -> int:
        """The base seed (64 bits) every stream is derived from; never checkpointed."""
        return self._base

    def stream_seed(self, purpose: str) -> int:
        """A seed for a data-processing stream of this run (e.g. the subsets of users' examples), re-derived like the
        others when the run is resumed (:meth:`restart`); never the noise's."""
        return derive_seed(self._base, purpose, self._restart)

    def _seed_sampling(self) -> None:
        rank_keys = ("rank", self._rank) if self._rank else ()
        self.sampling.manual_seed(derive_seed(self._base, "sampling", self._restart, *rank_keys))

    def share(self, base_seed: int, *, rank: int) -> None:
        """Adopt the base seed all ranks agreed on (rank 0's) as process ``rank`` of a multi-process run.

        Every stream is re-derived: the noise streams no longer depend on the device index (ranks on ``cuda:0`` and
        ``cuda:1`` draw the same noise; one rank may then use one device per type), the sampling stream depends on
        ``rank``. The ``sampling`` generator object is reseeded in place.

        Raises:
            ValueError: negative ``rank``.
        """
        if rank < 0:
            raise ValueError(f"rank must be non-negative, got {rank}")
        if self.secure:
            raise ValueError(
                "secure_mode=True is single-process: ranks cannot draw identical noise from fresh OS entropy; train on "
                "one process or set secure_mode=False"
            )
        self._base, self._rank = int(base_seed), int(rank)
        self._generators = {}
        self._seed_sampling()

    def noise_generator(self, device: torch.device | str, shard: tuple[int, ...] = ()) -> torch.Generator:
        """The noise generator living on ``device`` (created on first use).

        Args:
            device: where the noise is drawn.
            shard: for a sharded parameter, which shard this rank holds
                (:func:`lightning_dp.runtime.sharding.shard_key`): each shard has its own stream, the same on the ranks
                holding replicas of it; ``()`` (replicated parameters): the stream shared by all ranks.
        """
        return self._device_generator("noise", device, shard)

    def projection_generator(self, device: torch.device | str) -> torch.Generator:
        """The generator of the randomized clipping engines' projections on ``device`` (its own stream: the
        projections are part of the mechanism's randomness, DP-SGD-RC seed Algorithm 2)."""
        return self._device_generator("projection", device)

    def _device_generator(
        self, purpose: str, device: torch.device | str, shard: tuple[int, ...] = ()
    ) -> torch.Generator:
        device = indexed_device(device)
        key = (purpose, device, shard)
        if self.secure:
            generator = self._generators.setdefault(key, torch.Generator(device=device))
            generator.manual_seed(int.from_bytes(os.urandom(8), "little"))
            return generator
        if key not in self._generators:
            index = device.index or 0
            if self._rank is not None:  # shared across ranks: the stream must not depend on the rank's device
                if any(p == purpose and d.type == device.type and d != device for p, d, _ in self._generators):
                    raise RuntimeError(
                        f"Randomness requested on a second {device.type} device ({device}) in one rank of a "
                        "multi-process run; keep all trainable parameters of a rank on one device"
                    )
                index = 0
            generator = torch.Generator(device=device)
            shard_keys: tuple[int | str, ...] = ("shard", *shard) if shard else ()
            generator.manual_seed(derive_seed(self._base, purpose, device.type, index, self._restart, *shard_keys))
            self._generators[key] = generator
        return self._generators[key]

    def restart(self, steps_taken: int) -> None:
        """Re-derive every stream for a run resumed after ``steps_taken`` steps (fresh entropy when unseeded).

        The ``sampling`` generator object is reseeded in place, so loaders already holding it keep working. On
        several processes, share the base seed again afterwards (each rank drew its own entropy).
        """
        if self._user_seed is None:
            self._base = int.from_bytes(os.urandom(8), "little")
        self._restart = int(steps_taken) + 1
        self._generators = {}
        self._seed_sampling()
