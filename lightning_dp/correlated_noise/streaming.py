"""Streaming correlated noise: step ``t`` returns ``(C^{-1} Z)_t`` for model-sized tensors, one step at a time.

``Z_t`` is a list of tensors (one per parameter, any shapes), standard normal; the caller scales the output by
``sigma * clip_norm * sens(C)`` (the noise added to the clipped gradient sum of step ``t``). The state is the only
memory of the past that ``C^{-1}`` needs:

- :class:`BandedNoise` (``b``-banded ``C``): ``x_t = z_t - sum_{k=1..b-1} c_k x_{t-k}`` (forward substitution on
  ``C x = z``; Choquette-Choo et al. 2023, Algorithm 9). State: the last ``b - 1`` outputs, ``b - 1`` model-sized
  tensors. ``b = 1`` returns ``z_t`` itself.
- :class:`BLTNoise` (BLT ``C``, ``d`` buffers): ``x_t = z_t - sum_j w_j s_j``, then ``s_j <- theta_j s_j + x_t``
  (McMahan et al. 2024, Algorithm 3: ``C^{-1}`` streamed with ``C``'s own parameters, since
  ``sum_{k >= 1} c_k x_{t-k} = sum_j w_j sum_{k >= 1} theta_j^(k-1) x_{t-k}``). State: ``d`` model-sized tensors.

``C^{-1}`` is linear, so :meth:`CorrelatedNoise.correlate` may equally be given the already-scaled draw
``sigma * clip_norm * sens(C) * Z_t``; that is how ``b = 1`` stays bit-identical to DP-SGD's noise from the
Gaussian mechanism's own sampler (``N(0, s^2)`` drawn by ``normal_(0, s)`` is not always bit-equal to
``s * normal_(0, 1)``: on CPU, float32 tensors of fewer than 16 elements differ in the last bit).

The working dtype is the tensors' own, or float32 for 16-bit tensors (docs/design.md section 12.3): 16-bit ``Z_t``
is cast up before it is correlated, the state is kept in float32, and the outputs are cast back to ``Z_t``'s dtype.
:meth:`state_dict` / :meth:`load_state_dict` carry the step and the state, so a run checkpointed mid-band continues
with bit-identical noise (given the same ``Z``: the generator's state is the caller's). The state is noise (past
outputs, or decayed sums of them): like the generators' states it must stay out of any checkpoint that may be
released (docs/design.md section 5.1, item 4).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_dp.correlated_noise.strategies import BandedToeplitz, BufferedToeplitz, Strategy

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _working(like: torch.Tensor) -> torch.dtype:
    if not like.dtype.is_floating_point:
        raise TypeError(f"correlated noise needs floating-point tensors, got {like.dtype}")
    return torch.float32 if like.dtype in _LOW_PRECISION else like.dtype


def standard_normal(likes: Sequence[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
    """``Z_t``: i.i.d. ``N(0, 1)`` tensors shaped like ``likes`` (on their devices, in the working dtype), drawn from
    ``generator`` only (never the global RNG), in the order of ``likes``."""
    return [
        torch.empty(like.shape, dtype=_working(like), device=like.device).normal_(generator=generator) for like in likes
    ]


class CorrelatedNoise(abc.ABC):
    """The streaming ``C^{-1} Z`` of a strategy; one instance per training run (per shard under FSDP2).

    Use :meth:`correlate` with ``Z_t`` drawn by the caller's keyed streams, or :meth:`step` to draw it from a
    generator. Steps must come in order ``t = 0, 1, ..., `` (:attr:`step_index` counts them).
    """

    kind: str = ""

    def __init__(self) -> None:
        self.step_index = 0
        self._state: list[list[torch.Tensor]] = []  # one list of model-sized tensors per remembered vector
        self._restored = False  # a loaded state, moved to the devices of the next z on first use

    @property
    @abc.abstractmethod
    def num_buffers(self) -> int:
        """Model-sized tensors the state holds once warm (banded: ``b - 1``; BLT: ``d``)."""

    @abc.abstractmethod
    def _parameters(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def _advance(self, z: list[torch.Tensor]) -> list[torch.Tensor]: ...

    def correlate(self, z: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``(C^{-1} Z)_t`` for this step's ``z`` (a list of tensors, one per parameter; shapes fixed for the run).

        Args:
            z: ``Z_t``, standard normal, any shapes; not modified.

        Returns:
            ``x_t``, tensors of ``z``'s shapes, dtypes and devices (computed in float32 for 16-bit ``z``).

        Raises:
            ValueError: ``z`` does not match the shapes of the earlier steps.
            TypeError: a tensor of ``z`` is not floating-point.
        """
        z = list(z)
        if self._state and [t.shape for t in self._state[0]] != [t.shape for t in z]:
            raise ValueError(
                "the noise tensors changed shape mid-run: got "
                f"{[tuple(t.shape) for t in z]}, the state holds {[tuple(t.shape) for t in self._state[0]]}"
            )
        if self._restored:  # a checkpoint's state (read onto the CPU): onto each parameter's device
            self._state = [[t.to(zi.device) for t, zi in zip(vector, z, strict=True)] for vector in self._state]
            self._restored = False
        out = self._advance([t.to(_working(t)) for t in z])
        self.step_index += 1
        return [x.to(t.dtype) for x, t in zip(out, z, strict=True)]

    def step(self, likes: Sequence[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
        """Draw ``Z_t`` shaped like ``likes`` from ``generator`` (:func:`standard_normal`) and return
        ``(C^{-1} Z)_t`` cast to the dtypes of ``likes``."""
        z = standard_normal(likes, generator)
        return [x.to(like.dtype) for x, like in zip(self.correlate(z), likes, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        """The step, the strategy's parameters and the state tensors (references, updated in place by later steps;
        ``torch.save`` copies them). The state is noise: for a private resume file, never a released checkpoint."""
        return {"kind": self.kind, "step": self.step_index, **self._parameters(), "state": self._state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`.

        Raises:
            ValueError: the checkpoint is of another kind or strategy, or its state is not the one this strategy
                keeps after its step.
        """
        expected = {"kind": self.kind, **self._parameters()}
        found = {key: state.get(key) for key in expected}
        if found != expected:
            raise ValueError(f"the checkpoint's correlated noise {found} is not this run's {expected}")
        step, vectors = int(state["step"]), list(state["state"])
        if step < 0 or len(vectors) != self._remembered(step) or len({len(vector) for vector in vectors}) > 1:
            raise ValueError(
                f"the checkpoint's correlated noise state holds {len(vectors)} vectors after step {step}; "
                f"this strategy keeps {self._remembered(max(step, 0))}, each with one tensor per parameter"
            )
        self.step_index = step
        self._state = [[t.clone() for t in vector] for vector in vectors]
        self._restored = True

    def _remembered(self, step: int) -> int:
        """How many state vectors the stream holds after ``step`` steps."""
        return min(step, self.num_buffers)


class BandedNoise(CorrelatedNoise):
    """``(C^{-1} Z)_t`` for a :class:`~lightning_dp.correlated_noise.strategies.BandedToeplitz` ``C``, remembering the
    last ``b - 1`` outputs (most recent first). Source: Choquette-Choo et al. 2023, Algorithm 9."""

    kind = "banded"

    def __init__(self, strategy: BandedToeplitz) -> None:
        if not isinstance(strategy, BandedToeplitz):
            raise TypeError(f"BandedNoise needs a BandedToeplitz strategy, got {type(strategy).__name__}")
        super().__init__()
        self.strategy = strategy

    @property
    def num_buffers(self) -> int:
        return self.strategy.band - 1

    def _parameters(self) -> dict[str, Any]:
        return {"coefs": list(self.strategy.coefs)}

    def _advance(self, z: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.num_buffers == 0:
            return z
        out = []
        for i, zi in enumerate(z):
            xi = zi.clone()
            for k, past in enumerate(self._state, start=1):  # past = x_{t-k}
                xi.sub_(past[i], alpha=self.strategy.coefs[k])
            out.append(xi)
        if len(self._state) < self.num_buffers:
            newest = [x.clone() for x in out]
        else:  # reuse the oldest vector's memory: the state stays b - 1 tensors, no allocation once warm
            newest = self._state.pop()
            for buffer, x in zip(newest, out, strict=True):
                buffer.copy_(x)
        self._state.insert(0, newest)
        return out


class BLTNoise(CorrelatedNoise):
    """``(C^{-1} Z)_t`` for a :class:`~lightning_dp.correlated_noise.strategies.BufferedToeplitz` ``C`` with ``d``
    buffers ``s_j = sum_{k >= 1} theta_j^(k-1) x_{t-k}``. Source: McMahan et al. 2024, Algorithm 3."""

    kind = "blt"

    def __init__(self, strategy: BufferedToeplitz) -> None:
        if not isinstance(strategy, BufferedToeplitz):
            raise TypeError(f"BLTNoise needs a BufferedToeplitz strategy, got {type(strategy).__name__}")
        super().__init__()
        self.strategy = strategy

    @property
    def num_buffers(self) -> int:
        return self.strategy.num_buffers

    def _parameters(self) -> dict[str, Any]:
        return {"decays": list(self.strategy.decays), "scales": list(self.strategy.scales)}

    def _remembered(self, step: int) -> int:
        return self.num_buffers if step > 0 else 0

    def _advance(self, z: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for i, zi in enumerate(z):
            xi = zi.clone()
            if self._state:  # the buffers are zero before the first step
                for w, buffer in zip(self.strategy.scales, self._state, strict=True):
                    xi.sub_(buffer[i], alpha=w)
            out.append(xi)
        if not self._state:
            self._state = [[x.clone() for x in out] for _ in self.strategy.decays]
        else:
            for theta, buffer in zip(self.strategy.decays, self._state, strict=True):
                for b, x in zip(buffer, out, strict=True):
                    b.mul_(theta).add_(x)
        return out


def noise_stream(strategy: Strategy) -> CorrelatedNoise:
    """The streaming noise of ``strategy``: :class:`BandedNoise` or :class:`BLTNoise`.

    Raises:
        TypeError: ``strategy`` is neither a ``BandedToeplitz`` nor a ``BufferedToeplitz``.
    """
    if isinstance(strategy, BandedToeplitz):
        return BandedNoise(strategy)
    if isinstance(strategy, BufferedToeplitz):
        return BLTNoise(strategy)
    raise TypeError(f"no streaming noise for {type(strategy).__name__}; pass a BandedToeplitz or BufferedToeplitz")
