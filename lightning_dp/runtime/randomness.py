"""The dedicated random streams of a DP run: noise (one generator per device) and Poisson sampling.

Never the global RNG; derived from one base seed with ``numpy.random.SeedSequence``; never checkpointed (a resumed
run calls :meth:`DPRandomness.restart`) unless the run asks for ``exact_resume`` (:meth:`DPRandomness.state_dict`, a
secret state); shared across ranks with :meth:`DPRandomness.share`; ``secure=True`` reseeds each noise or projection
generator from ``os.urandom`` at every request (single-process only). See docs/design.md sections 3.4 and 8.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def os_seed() -> int:
    """64 bits of fresh entropy from the operating system's CSPRNG (``os.urandom``): the base of an unseeded run and
    every reseed in secure mode."""
    return int.from_bytes(os.urandom(8), "little")


def derive_seed(base: int, *keys: int | str) -> int:
    """A 63-bit seed for the stream named by ``keys``, derived from ``base`` with ``SeedSequence``."""
    entropy = [int(base) & (2**64 - 1)] + [zlib.crc32(k.encode()) if isinstance(k, str) else int(k) for k in keys]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> 1)


def indexed_device(device: torch.device | str) -> torch.device:
    """``device`` with its index (``"cuda"`` -> the current CUDA device, other accelerators index 0; ``cpu`` stays), so
    ``"cuda"`` and ``"cuda:0"`` name one device.
    """
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        return torch.device(device.type, torch.cuda.current_device() if device.type == "cuda" else 0)
    return device


class DPRandomness:
    """Noise and sampling generators derived from one seed.

    Args:
        seed: base seed for reproducible experiments; ``None`` (recommended for real runs) draws 64 bits from
            ``os.urandom``. Checkpointed only with ``exact_resume`` (:meth:`state_dict`).
        secure: reseed the noise and projection generators from ``os.urandom`` at every request.

    Raises:
        ValueError: a ``seed`` with ``secure=True``.
    """

    def __init__(self, seed: int | None = None, *, secure: bool = False) -> None:
        if secure and seed is not None:
            raise ValueError(f"secure randomness draws from the OS CSPRNG and takes no seed, got seed={seed}")
        self.secure = secure
        self._user_seed = seed
        self._base = int(seed) if seed is not None else os_seed()
        self._restart = 0
        self._rank: int | None = None
        self._generators: dict[tuple[str, torch.device, tuple[int, ...]], torch.Generator] = {}
        self._saved_states: dict[str, torch.Tensor] = {}  # load_state_dict's, applied when each stream is created
        self._resumed_names: frozenset[str] = frozenset()  # the streams load_state_dict restored
        self.sampling = torch.Generator()
        self._seed_sampling()

    @property
    def base_seed(self) -> int:
        """The base seed (64 bits) every stream is derived from; checkpointed only with ``exact_resume``."""
        return self._base

    def stream_seed(self, purpose: str) -> int:
        """A seed for a data-processing stream (never the noise's), re-derived on :meth:`restart`."""
        return derive_seed(self._base, purpose, self._restart)

    def _seed_sampling(self) -> None:
        self.sampling.manual_seed(derive_seed(self._base, "sampling", self._restart, *self._rank_keys()))

    def _rank_keys(self) -> tuple[int | str, ...]:
        return ("rank", self._rank) if self._rank else ()

    def step_sampling_seed(self, step: int) -> int:
        """The seed of the sampling draws of optimizer step ``step`` (this rank's), for samplers keyed by the step
        (``exact_resume``): a resumed run draws the batches of the uninterrupted one, whatever it drew before."""
        return derive_seed(self._base, "sampling", self._restart, *self._rank_keys(), "step", int(step))

    def share(self, base_seed: int, *, rank: int) -> None:
        """Adopt the agreed base seed (rank 0's) as process ``rank``: noise streams independent of the device index, the
        sampling stream keyed by ``rank`` (its generator reseeded in place). Sharing what is already shared (a second
        ``fit`` of the same run) keeps every stream where it is: re-deriving them would replay their draws.

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
        if (int(base_seed), int(rank)) == (self._base, self._rank):
            return
        self._base, self._rank = int(base_seed), int(rank)
        self._generators = {}
        self._seed_sampling()

    def noise_generator(self, device: torch.device | str, shard: tuple[int, ...] = ()) -> torch.Generator:
        """The noise generator on ``device`` (created on first use).

        Args:
            device: where the noise is drawn.
            shard: a sharded parameter's :func:`~lightning_dp.runtime.sharding.shard_key` (its own stream); ``()``: the
                stream shared by all ranks.
        """
        return self._device_generator("noise", device, shard)

    def projection_generator(self, device: torch.device | str) -> torch.Generator:
        """The generator of the randomized engines' projections on ``device`` (DP-SGD-RC seed, Algorithm 2)."""
        return self._device_generator("projection", device)

    def _device_generator(
        self, purpose: str, device: torch.device | str, shard: tuple[int, ...] = ()
    ) -> torch.Generator:
        device = indexed_device(device)
        key = (purpose, device, shard)
        if self.secure:
            generator = self._generators.setdefault(key, torch.Generator(device=device))
            generator.manual_seed(os_seed())
            return generator
        if key not in self._generators:
            if self._rank is not None:  # shared across ranks: the stream must not depend on the rank's device
                if any(p == purpose and d.type == device.type and d != device for p, d, _ in self._generators):
                    raise RuntimeError(
                        f"Randomness requested on a second {device.type} device ({device}) in one rank of a "
                        "multi-process run; keep all trainable parameters of a rank on one device"
                    )
            generator = torch.Generator(device=device)
            shard_keys: tuple[int | str, ...] = ("shard", *shard) if shard else ()
            index = self._seed_index(device)
            generator.manual_seed(derive_seed(self._base, purpose, device.type, index, self._restart, *shard_keys))
            self._continue_saved(generator, key)
            self._generators[key] = generator
        return self._generators[key]

    def _continue_saved(self, generator: torch.Generator, key: tuple[str, torch.device, tuple[int, ...]]) -> None:
        """After :meth:`load_state_dict`: continue ``generator``'s stream where the checkpoint left it (once); a stream
        the checkpoint does not hold starts from its seed, as in the uninterrupted run, unless the checkpoint holds
        that stream on another device (it would then replay draws already added).

        Raises:
            RuntimeError: the checkpoint holds the stream on another device.
        """
        name = self._stream_name(key)
        saved = self._saved_states.pop(name, None)
        if saved is not None:
            generator.set_state(saved)
            return
        elsewhere = [n for n in self._resumed_names if n.split("/")[::3] == name.split("/")[::3] and n != name]
        if elsewhere:
            raise RuntimeError(
                f"exact_resume: the checkpoint's {key[0]} stream was drawn as {elsewhere}, this run draws it as "
                f"{name!r} (another device): resume on the same devices, or without exact_resume"
            )

    def _seed_index(self, device: torch.device) -> int:
        """The device index a stream's seed is keyed by: 0 on several processes (the ranks share the streams)."""
        return 0 if self._rank is not None else device.index or 0

    def _stream_name(self, key: tuple[str, torch.device, tuple[int, ...]]) -> str:
        """``purpose/device type/seed index/shard``: a generator's name in :meth:`state_dict`."""
        purpose, device, shard = key
        return f"{purpose}/{device.type}/{self._seed_index(device)}/{','.join(map(str, shard))}"

    def state_dict(self) -> dict[str, Any]:
        """The run's secret randomness, for ``exact_resume``: the base seed, the restart count and the state of every
        noise and projection generator created so far or restored and not used since (``{name: uint8 tensor}``).
        Whoever holds it can recompute the noise: it belongs in a private resume file, never in a released checkpoint
        (docs/design.md section 2.3).

        Raises:
            ValueError: in secure mode (its streams are fresh OS entropy, which cannot be continued).
        """
        if self.secure:
            raise ValueError("secure_mode=True draws fresh OS entropy for every request: its streams cannot be saved")
        live = {self._stream_name(key): generator.get_state() for key, generator in self._generators.items()}
        # a restored stream not requested since is saved as restored: without it a later resume would start it afresh
        return {"base_seed": self._base, "restart": self._restart, "generators": {**self._saved_states, **live}}

    @property
    def untouched_streams(self) -> frozenset[str]:
        """The streams :meth:`load_state_dict` restored that have not been requested since: :meth:`state_dict` holds
        them as the checkpoint left them."""
        return frozenset(self._saved_states)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the streams of :meth:`state_dict` (a resume that does not :meth:`restart`): the base seed and the
        restart count are restored, the sampling generator is reseeded, and each saved generator state is applied when
        its stream is next requested. On several processes, share the base seed again afterwards.

        Raises:
            ValueError: in secure mode; a malformed state (no integer ``base_seed`` and ``restart >= 0``, generator
                states that are not ``uint8`` tensors).
        """
        if self.secure:
            raise ValueError("secure_mode=True draws fresh OS entropy for every request: its streams cannot be resumed")
        base, restart, generators = (state.get(key) for key in ("base_seed", "restart", "generators"))
        if (
            not all(isinstance(v, int) and not isinstance(v, bool) for v in (base, restart))
            or restart < 0  # type: ignore[operator]
            or not isinstance(generators, Mapping)
            or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in generators.values())
        ):
            raise ValueError(f"not a saved DPRandomness state: {sorted(state)}")
        self._base, self._restart = int(base), int(restart)  # type: ignore[arg-type]
        self._generators = {}
        self._saved_states = {str(name): t.cpu() for name, t in generators.items()}
        self._resumed_names = frozenset(self._saved_states)
        self._seed_sampling()

    def restart(self, steps_taken: int) -> None:
        """Re-derive every stream for a run resumed after ``steps_taken`` steps (fresh entropy when unseeded); the
        sampling generator is reseeded in place. On several processes, share the base seed again afterwards.
        """
        if self._user_seed is None:
            self._base = os_seed()
        self._restart = int(steps_taken) + 1
        self._generators, self._saved_states, self._resumed_names = {}, {}, frozenset()
        self._seed_sampling()
