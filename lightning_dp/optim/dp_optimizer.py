"""DPOptimizer: privatise the clipped gradient sum once per logical step, then step the user's optimizer.

Order of one step (docs/design.md section 2.2): the closure (forward, per-sample clipping, clipped sum accumulated in
``p.grad``) -> noise from the mechanism, drawn once from a dedicated generator -> division by the EXPECTED
batch size ``q N`` (the realised size would leak it) -> the wrapped optimizer's ``step()`` without closure ->
``on_step`` (the accountant records the step). An optional ``postprocess`` (e.g. the low-pass filter of
:mod:`lightning_dp.optim.lowpass`) transforms the noisy, rescaled gradients in place right before the wrapped step:
it only reads released values, so it is post-processing and costs no privacy. On several processes the clipped
sums are first all-reduced with ``reduce_clipped_sum`` (see :mod:`lightning_dp.runtime.distributed`), so the noise is
added once, to the global sum. Sharded gradients (FSDP2 ``DTensor`` shards, :mod:`lightning_dp.runtime.sharding`)
already hold the sum over the ranks of their shard; each rank noises its own shard, from that shard's noise stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_dp.mechanisms.base import NoiseMechanism
from lightning_dp.mechanisms.secure import check_secure_mechanism, secure_sample
from lightning_dp.runtime.randomness import DPRandomness
from lightning_dp.runtime.sharding import is_sharded, local_part, shard_key


def _clipped_sum(p: torch.nn.Parameter) -> torch.Tensor:
    """``p.grad``, where the clipped sum of a trainable parameter is (:meth:`DPOptimizer.privatise` fills a missing
    one with zeros first)."""
    grad = p.grad
    assert grad is not None, "a trainable parameter has no clipped sum in .grad"
    return grad


def _finite_extremes(tensor: torch.Tensor) -> torch.Tensor:
    """0-dim bool: every entry of ``tensor`` is finite (True for an empty tensor)."""
    if tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    low, high = torch.aminmax(tensor)
    return torch.isfinite(low) & torch.isfinite(high)


def check_finite_clipped_sum(
    params: Sequence[torch.nn.Parameter], any_rank: Callable[[Sequence[bool]], list[bool]] | None = None
) -> None:
    """Raise before any noise is added when a clipped sum ``p.grad`` holds a non-finite value (one host sync).

    The per-sample clipper drops examples whose loss or gradient is not finite (their contribution is zero), so a
    non-finite sum here comes from a gradient written outside the per-sample clipping: a second ``backward`` of a
    loss that is not per sample, a hook or callback writing ``p.grad``, a gradient canary. Adding noise to it would
    release a NaN or inf whose presence depends on the data; stopping releases nothing.

    Args:
        params: the trainable parameters, each with its clipped sum in ``.grad``.
        any_rank: OR of flags over the ranks (:meth:`~lightning_dp.runtime.distributed.DistributedContext.any_rank`):
            with sharded gradients each rank sees only its shards, so the ranks agree before raising (all raise).

    Raises:
        FloatingPointError: naming the first parameters (position among the trainable ones, and shape) at fault.
    """
    if not params:
        return
    device = local_part(_clipped_sum(params[0])).device
    # min and max propagate NaN and hold any inf: one pass without a boolean copy of each gradient (isfinite on
    # the 14.5M parameters of a small GPT-2 costs as much as drawing their noise).
    finite = torch.stack([_finite_extremes(local_part(_clipped_sum(p))).to(device) for p in params])
    if any_rank is not None and any(is_sharded(_clipped_sum(p)) for p in params):
        finite = ~torch.tensor(any_rank((~finite).tolist()), device=device)
    if bool(finite.all()):
        return
    bad = [f"#{i} {tuple(params[i].shape)}" for i in torch.nonzero(~finite).flatten().tolist()[:5]]
    raise FloatingPointError(
        f"the clipped gradient sum of trainable parameter(s) {', '.join(bad)} is not finite before the noise is "
        "added. Per-sample clipping drops examples whose loss or gradient is not finite, so the value comes from a "
        "gradient written outside it (a second backward of a loss that is not per sample, a hook or callback "
        "writing p.grad); no noise was added and no step was taken. Remove that write, or make the loss per sample"
    )


class DPOptimizer(Optimizer):
    """Wraps an optimizer so each ``step`` adds noise to the clipped gradient sum and rescales it.

    ``param_groups``, ``state`` and ``defaults`` are shared with the wrapped optimizer, so learning-rate
    schedulers built on the original keep working, and ``state_dict`` is the original's.

    Args:
        optimizer: the user's optimizer.
        mechanism: the noise mechanism (adds noise to the SUM of clipped per-sample gradients).
        expected_batch_size: ``q N`` (examples per logical step, in expectation); the noisy sum is divided by it.
        randomness: the run's dedicated generators (noise is drawn from its per-device noise generator).
        on_step: called after each completed step (records the step with the accountant).
        before_update: called right before the wrapped optimizer updates the parameters, at each step that is taken
            (per-sample momentum stores the iterate there); a ``step()`` of the wrapped optimizer alone never calls
            it (torch's sharded state helpers run one, at learning rate 0, to create a missing optimizer state).
        should_skip: called before privatising; when it returns True the step is skipped entirely (budget guard).
        reduce_clipped_sum: on several processes, sums the ranks' clipped sums in place (a SUM all-reduce over the
            list of ``p.grad``, e.g. :meth:`~lightning_dp.runtime.distributed.DistributedContext.reduce_clipped_sum`)
            before the noise is added; ``None`` on one process.
        any_rank: on several processes, the OR of flags over the ranks (for the finite check of sharded sums);
            ``None`` on one process.
        secure_mode: draw the noise with :func:`~lightning_dp.mechanisms.secure.secure_sample` (same law, samplers
            hardened against floating-point attacks); pair it with ``DPRandomness(secure=True)``.
        postprocess: called with the list of noisy, rescaled ``p.grad`` (one per trainable parameter) once per
            logical step, after the division by ``q N`` and before the wrapped optimizer's step; it replaces them in
            place (e.g. :meth:`~lightning_dp.optim.lowpass.LowPassFilter.apply_`). ``None``: no post-processing.

    Raises:
        ValueError: non-positive ``expected_batch_size``.
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
    ) -> None:
        if secure_mode:
            check_secure_mechanism(mechanism)
        if not expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be positive, got {expected_batch_size}")
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
        self._privatised = False
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
        """Trainable parameters of all groups (the ones that receive noise)."""
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

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
        """``p.grad <- (p.grad + noise) / (q N)`` for every trainable parameter; a missing grad counts as zero.

        With ``reduce_clipped_sum``, ``p.grad`` is first replaced by the sum over all ranks; then the
        ``clipped_sum_hooks`` run; then the sums must be finite (:func:`check_finite_clipped_sum`); with
        ``postprocess``, the noisy, rescaled result is post-processed in place (on several processes the noisy
        gradient is identical on every rank, so a deterministic post-processing such as the low-pass filter stays
        identical too).

        Raises:
            FloatingPointError: a clipped sum is not finite; nothing is noised or stepped (on several processes every
                rank raises, since the sums are reduced first).
        """
        params = self.params
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.reduce_clipped_sum is not None:
            self.reduce_clipped_sum([_clipped_sum(p) for p in params])
        for hook in self.clipped_sum_hooks:
            hook(params)
        check_finite_clipped_sum(params, self.any_rank)
        for p in params:
            clipped_sum = _clipped_sum(p)
            grad = local_part(clipped_sum)  # a sharded gradient: this rank's shard, noised from that shard's stream
            shard = shard_key(clipped_sum) if is_sharded(clipped_sum) else ()
            generator = self.randomness.noise_generator(grad.device, shard)
            if self.secure_mode:
                grad.add_(secure_sample(self.mechanism, grad, generator))
            else:
                grad.add_(self.mechanism.sample(grad, generator))
            grad.div_(self.expected_batch_size)
        self._privatised = True  # only now: after a failure above, the next step privatises again
        if self.postprocess is not None:
            self.postprocess([_clipped_sum(p) for p in params])

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
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.original_optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.original_optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"DPOptimizer({self.original_optimizer!r}, mechanism={self.mechanism.name})"
