"""DPOptimizer: privatise the clipped gradient sum once per logical step, then step the user's optimizer.

One step (docs/design.md section 2.2): closure (clipped sum in ``p.grad``) -> SUM all-reduce over ranks (several
processes) -> noise, drawn once from a dedicated generator -> division by the EXPECTED batch size ``q N`` ->
optional ``postprocess`` (post-processing, e.g. :mod:`lightning_dp.optim.lowpass`) -> the wrapped ``step()`` ->
``on_step`` (the accountant records it). Sharded gradients (FSDP2) are noised per shard, from that shard's stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_dp.clipping.float32_sums import discard_float32_sums, take_float32_sums
from lightning_dp.correlated_noise.streaming import CorrelatedNoise
from lightning_dp.mechanisms.base import NoiseMechanism
from lightning_dp.mechanisms.sampling import add_in_pieces
from lightning_dp.mechanisms.secure import check_secure_mechanism, secure_sample
from lightning_dp.runtime.randomness import DPRandomness
from lightning_dp.runtime.sharding import is_sharded, local_part, shard_key


def _divide(grads: list[torch.Tensor], divisor: float | torch.Tensor) -> None:
    """``g /= divisor`` for every gradient, in one foreach call per device (a tensor ``divisor`` stays on its device:
    no host read)."""
    if not grads:
        return
    if isinstance(divisor, float) or all(g.device == divisor.device for g in grads):
        torch._foreach_div_(grads, divisor)
        return
    for grad in grads:
        grad.div_(divisor.to(grad.device))


def _clipped_sum(p: torch.nn.Parameter) -> torch.Tensor:
    """``p.grad``, where the clipped sum of a trainable parameter is (:meth:`DPOptimizer.privatise` fills a missing
    one with zeros first)."""
    grad = p.grad
    assert grad is not None, "a trainable parameter has no clipped sum in .grad"
    return grad


#: Period, in privatised steps, of the host read of the deferred finite check of the clipped sums: the first step is
#: checked at once, then every FINITE_CHECK_EVERY-th, at checkpoints and at the end of the run (docs/design.md 9.2).
FINITE_CHECK_EVERY = 100


def nonfinite_flags(sums: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[P]`` bool on the first clipped sum's device: True where a clipped sum (this rank's part) is not all finite.

    No host sync: one ``aminmax`` per parameter (min and max propagate NaN and hold any inf: one pass without a boolean
    copy of each gradient, which on the 14.5M parameters of a small GPT-2 costs as much as drawing their noise), then
    one ``stack`` and one ``isfinite`` over all the extremes.
    """
    grads = [local_part(clipped_sum) for clipped_sum in sums]
    device = grads[0].device
    zero = torch.zeros((), device=device)
    extremes = [v.to(device) for g in grads for v in (torch.aminmax(g) if g.numel() else (zero, zero))]
    return ~torch.isfinite(torch.stack(extremes).view(len(grads), 2)).all(1)


def raise_if_nonfinite(
    params: Sequence[torch.nn.Parameter],
    flags: Sequence[bool],
    *,
    deferred: tuple[int, int] | None = None,
    every: int = FINITE_CHECK_EVERY,
) -> None:
    """Raise if any of ``flags`` (read from :func:`nonfinite_flags`, one per parameter) is set.

    Such a sum comes from a gradient written outside the per-sample clipping (a second ``backward``, a hook, a canary);
    releasing it noised would leak whether it occurred (docs/design.md section 9.2).

    Args:
        params: the trainable parameters.
        flags: whether each one's clipped sum was not finite.
        deferred: ``(first, last)`` step numbers of a deferred check (the sums were noised and every gradient of the
            step at fault set to NaN); ``None``: the check of this step, before its noise.
        every: the period of the reads (named in the message of a deferred check).

    Raises:
        FloatingPointError: naming the first parameters (position among the trainable ones, and shape) at fault.
    """
    bad = [f"#{i} {tuple(params[i].shape)}" for i, flag in enumerate(flags) if flag][:5]
    if not bad:
        return
    if deferred is None:
        when = "is not finite before the noise is added"
        effect = "no noise was added and no step was taken"
    else:
        when = f"was not finite before the noise was added, at one of the optimizer steps {deferred[0]}-{deferred[1]}"
        effect = (
            "that step set every gradient to NaN, so its update released no number (every parameter is NaN now); "
            "the check reads a flag on the device at the first step, every "
            f"{every}th step, at checkpoints and at the end of training"
        )
    raise FloatingPointError(
        f"the clipped gradient sum of trainable parameter(s) {', '.join(bad)} {when}. Per-sample clipping drops "
        "examples whose loss or gradient is not finite, so the value comes from a gradient written outside it (a "
        "second backward of a loss that is not per sample, a hook or callback writing p.grad); "
        f"{effect}. Remove that write, or make the loss per sample"
    )


def check_finite_clipped_sum(
    params: Sequence[torch.nn.Parameter], any_rank: Callable[[Sequence[bool]], list[bool]] | None = None
) -> None:
    """Raise before any noise is added when a clipped sum ``p.grad`` holds a non-finite value (one host sync).

    Args:
        params: the trainable parameters, each with its clipped sum in ``.grad``.
        any_rank: OR of flags over the ranks (sharded gradients: the ranks agree before raising, all raise).

    Raises:
        FloatingPointError: as :func:`raise_if_nonfinite`.
    """
    if not params:
        return
    flags = nonfinite_flags([_clipped_sum(p) for p in params]).tolist()
    if any_rank is not None and any(is_sharded(_clipped_sum(p)) for p in params):
        flags = any_rank(flags)
    raise_if_nonfinite(params, flags)


def noised_params(optimizer: Optimizer) -> list[torch.nn.Parameter]:
    """The trainable parameters of all of ``optimizer``'s groups, in the order a :class:`DPOptimizer` wrapping it
    noises them."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


class DPOptimizer(Optimizer):
    """Wraps an optimizer so each ``step`` adds noise to the clipped gradient sum and rescales it.

    ``param_groups``, ``state`` and ``defaults`` are shared with the wrapped optimizer (schedulers keep working), and
    ``state_dict`` is the original's.

    Args:
        optimizer: the user's optimizer.
        mechanism: the noise mechanism (adds noise to the SUM of clipped per-sample gradients).
        expected_batch_size: ``q N`` (examples per logical step, in expectation); the noisy sum is divided by it.
        randomness: the run's dedicated generators (noise from its per-device noise generator).
        on_step: called after each completed step (records the step with the accountant).
        before_update: called right before the wrapped optimizer updates the parameters, at each step taken (not by a
            ``step()`` of the wrapped optimizer alone).
        should_skip: called before privatising; True skips the step entirely (budget guard).
        reduce_clipped_sum: several processes: SUM all-reduce of the list of ``p.grad`` in place, before the noise;
            ``None`` on one process.
        any_rank: several processes: the OR of flags over the ranks; ``None`` on one process.
        secure_mode: draw the noise with :func:`~lightning_dp.mechanisms.secure.secure_sample`; pair it with
            ``DPRandomness(secure=True)``.
        postprocess: called with the noisy, rescaled ``p.grad`` list once per logical step, before the wrapped step;
            replaces them in place. ``None``: no post-processing.
        finite_check_every: period in privatised steps of the host read of the finite check (see :meth:`privatise`).
        correlation: a streaming ``C^{-1}`` (:class:`~lightning_dp.correlated_noise.CorrelatedNoise`, fresh: empty
            state) through which each step's draws of ``mechanism`` pass before they are added (banded matrix
            factorization, docs/design.md section 5.1); ``None``: independent noise.

    Raises:
        ValueError: non-positive ``expected_batch_size`` or ``finite_check_every``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        mechanism: NoiseMechanism,
        expected_batch_size: float,
        randomness: DPRandomness,
        on_step: Callable[[], None] = lambda: None,
        before_update: Callable[[], None] = lambda: None,
        should_skip: Callable[[], bool] = lambda: False,
        reduce_clipped_sum: Callable[[Sequence[torch.Tensor]], None] | None = None,
        any_rank: Callable[[Sequence[bool]], list[bool]] | None = None,
        secure_mode: bool = False,
        postprocess: Callable[[Sequence[torch.Tensor]], None] | None = None,
        finite_check_every: int = FINITE_CHECK_EVERY,
        correlation: CorrelatedNoise | None = None,
    ) -> None:
        if secure_mode:
            check_secure_mechanism(mechanism)
        if not expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be positive, got {expected_batch_size}")
        if finite_check_every < 1:
            raise ValueError(f"finite_check_every must be a positive number of steps, got {finite_check_every}")
        # Deliberately no Optimizer.__init__: the groups and state are the wrapped optimizer's own objects.
        self.original_optimizer = optimizer
        self.mechanism = mechanism
        self.expected_batch_size = float(expected_batch_size)
        self.randomness = randomness
        self.on_step = on_step
        self.before_update = before_update
        self.should_skip = should_skip
        self.reduce_clipped_sum = reduce_clipped_sum
        self.any_rank = any_rank
        self.secure_mode = secure_mode
        #: called with the trainable parameters after the clipped sums are in ``p.grad`` (and all-reduced) and
        #: before the noise is added; used by :mod:`lightning_dp.audit` to inject gradient canaries.
        self.clipped_sum_hooks: list[Callable[[Sequence[torch.nn.Parameter]], None]] = []
        self.postprocess = postprocess
        self.finite_check_every = finite_check_every
        #: the streaming correlation of the noise; its state is noise, never in a checkpoint (:meth:`state_dict`).
        self.correlation = correlation
        self._privatised = False
        #: privatised steps so far; the deferred finite flags (``[P]`` bool on the device, OR over the steps since the
        #: last read, ``None`` when none) and the first of those steps.
        self._steps = 0
        self._pending: torch.Tensor | None = None
        self._pending_first = 0
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.original_optimizer.param_groups = groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.original_optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.original_optimizer.defaults

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """Trainable parameters of all groups (the ones that receive noise): :func:`noised_params`."""
        return noised_params(self)

    def privatising(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` followed at once by :meth:`privatise`.

        Lightning's precision plugin runs ``on_before_optimizer_step`` hooks (where gradient norms are commonly
        logged) right after the closure, inside ``step``; wrapping the closure makes those hooks see the noisy,
        rescaled gradient, never the noise-free clipped sum.
        """

        def closure_then_privatise() -> Any:
            result = closure()
            if not self.should_skip():
                self.privatise()
            return result

        return closure_then_privatise

    def privatise(self) -> None:
        """``p.grad <- (p.grad + noise) / (q N)`` for every trainable parameter; a missing grad counts as zero. A
        16-bit parameter's clipped sum is its float32 sum (:mod:`~lightning_dp.clipping.float32_sums`) plus its
        ``.grad``, noised and divided in float32 and only then cast into ``.grad``.

        Order: ``reduce_clipped_sum``, the ``clipped_sum_hooks``, the finite check, noise and division,
        ``postprocess``.

        The finite check (docs/design.md section 9.2) keeps its flags on the device and reads them (one host sync) at
        the first step, every :attr:`finite_check_every`-th step and at :meth:`check_finite` (checkpoints, the end of
        the run); a step that reads raises before its noise. At the other steps a non-finite sum divides every
        gradient by NaN instead of ``q N`` (no host read decides it): none of that step's sums is released as a
        number, every parameter becomes NaN, and the next read raises. Sharded gradients are checked at every step
        (the ranks agree through ``any_rank``).

        Raises:
            FloatingPointError: a clipped sum is not finite; nothing is noised or stepped at a reading step (every rank
                raises).
        """
        params = self.params
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        wide = take_float32_sums(params)  # 16-bit parameters: their float32 sums, noised in float32, then cast
        sums = [_clipped_sum(p) if w is None else w for p, w in zip(params, wide, strict=True)]
        if self.reduce_clipped_sum is not None:
            self.reduce_clipped_sum(sums)
        for hook in self.clipped_sum_hooks:
            hook(params)
        for p, clipped_sum, w in zip(params, sums, wide, strict=True):
            if w is not None:  # what was written into the 16-bit .grad outside the clipper (zeros otherwise)
                clipped_sum.add_(_clipped_sum(p))
        divisor = self._finite_check(params, sums)
        grads = [local_part(clipped_sum) for clipped_sum in sums]  # sharded: this rank's shard, from its own stream
        if self.correlation is None:
            for grad, clipped_sum in zip(grads, sums, strict=True):
                self._add_noise(grad, clipped_sum)
        else:  # all of the step's draws at once: C^{-1} mixes them with the past steps'
            draws = self.correlation.correlate([self._draw(grad, s) for grad, s in zip(grads, sums, strict=True)])
            for grad, noise in zip(grads, draws, strict=True):
                grad.add_(noise)
        _divide(grads, divisor)
        for p, clipped_sum, w in zip(params, sums, wide, strict=True):
            if w is not None:
                _clipped_sum(p).copy_(clipped_sum)  # rounded to the parameter's dtype after the noise
        self._steps += 1
        self._privatised = True  # only now: after a failure above, the next step privatises again
        if self.postprocess is not None:
            self.postprocess([_clipped_sum(p) for p in params])

    def _draw(self, grad: torch.Tensor, clipped_sum: torch.Tensor) -> torch.Tensor:
        """The mechanism's noise for ``grad`` (a clipped sum, or a sharded one's local part), from the noise generator
        of its device and shard; the hardened sampler in ``secure_mode``."""
        shard = shard_key(clipped_sum) if is_sharded(clipped_sum) else ()
        generator = self.randomness.noise_generator(grad.device, shard)
        if self.secure_mode:
            return secure_sample(self.mechanism, grad, generator)
        return self.mechanism.sample(grad, generator)

    def _add_noise(self, grad: torch.Tensor, clipped_sum: torch.Tensor) -> None:
        """``grad += noise`` (:meth:`_draw`); piece by piece on the CPU where the mechanism allows it
        (:func:`~lightning_dp.mechanisms.sampling.add_in_pieces`), the same bits as one draw for Gaussian noise."""
        if self.mechanism.piecewise and not self.secure_mode and grad.device.type == "cpu" and grad.is_contiguous():
            add_in_pieces(grad, lambda piece: self._draw(piece, clipped_sum))
        else:
            grad.add_(self._draw(grad, clipped_sum))

    def _finite_check(self, params: Sequence[torch.nn.Parameter], sums: Sequence[torch.Tensor]) -> float | torch.Tensor:
        """Check now (a reading step, or sharded gradients) and return ``q N``; or defer: record the flags and return
        ``q N`` as a 0-dim float64 tensor that is NaN when a sum is not finite (see :meth:`privatise`)."""
        if not params:
            return self.expected_batch_size
        if self.any_rank is not None and any(is_sharded(_clipped_sum(p)) for p in params):
            check_finite_clipped_sum(params, self.any_rank)
            return self.expected_batch_size
        flags = nonfinite_flags(sums)
        if self._steps == 0 or (self._steps + 1) % self.finite_check_every == 0:
            self._read_flags(params, flags)
            return self.expected_batch_size
        if self._pending is None:
            self._pending, self._pending_first = flags, self._steps + 1
        else:
            self._pending = self._pending | flags
        divisor = torch.full((), self.expected_batch_size, dtype=torch.float64, device=flags.device)
        return divisor.masked_fill_(flags.any(), math.nan)

    def _read_flags(self, params: Sequence[torch.nn.Parameter], flags: torch.Tensor | None) -> None:
        """Read this step's ``flags`` (before its noise) and the deferred ones in one host sync; raise for either."""
        rows = ([] if self._pending is None else [self._pending]) + ([] if flags is None else [flags])
        if not rows:
            return
        read = torch.stack(rows).tolist()
        if self._pending is not None:  # kept when set: every later read raises again
            deferred = (self._pending_first, self._steps)
            raise_if_nonfinite(params, read[0], deferred=deferred, every=self.finite_check_every)
            self._pending = None
        if flags is not None:
            raise_if_nonfinite(params, read[-1])

    def check_finite(self) -> None:
        """Read the deferred finite flags now (one host sync, none when there are none): the adapters call it at
        checkpoints and at the end of a run (:meth:`~lightning_dp.engine.privacy_engine.PrivacyEngine.check_finite`).

        Raises:
            FloatingPointError: a clipped sum was not finite at a step since the last read.
        """
        self._read_flags(self.params, None)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (which accumulates the clipped sum), privatise (unless the closure came through
        :meth:`privatising` and already did), call ``before_update``, step the wrapped optimizer, record the step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.should_skip():
            self._privatised = False
            return loss
        if not self._privatised:
            self.privatise()
        self._privatised = False
        self.before_update()
        self.original_optimizer.step()
        self.on_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        discard_float32_sums(self.params)
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.original_optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.check_finite()  # the deferred flags are per parameter of the current groups
        self.original_optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"DPOptimizer({self.original_optimizer!r}, mechanism={self.mechanism.name})"
