"""DPOptimizer: privatise the clipped gradient sum once per logical step, then step the user's optimizer.

Order of one step (DESIGN.md section 2): the closure (forward, per-sample clipping, clipped sum accumulated in
``p.grad``) -> noise from the mechanism, drawn once from a dedicated generator -> division by the EXPECTED
batch size ``q N`` (the realised size would leak it) -> the wrapped optimizer's ``step()`` without closure ->
``on_step`` (the accountant records the step).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_dp.mechanisms.base import NoiseMechanism


class NoiseGenerators:
    """One ``torch.Generator`` per device, all derived from one seed; never the global RNG.

    Args:
        seed: base seed; ``None`` draws a fresh one from the OS entropy pool (``torch.seed`` is not used: it would
            touch the global RNG).
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = int(seed) if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self._generators: dict[torch.device, torch.Generator] = {}

    def get(self, device: torch.device) -> torch.Generator:
        """The generator for ``device`` (created and seeded on first use)."""
        device = torch.device(device)
        if device not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed + (device.index or 0) + 1_000 * (device.type != "cpu"))
            self._generators[device] = generator
        return self._generators[device]

    def state_dict(self) -> dict[str, Any]:
        """Seed and per-device generator states (CPU tensors), for checkpoints."""
        return {"seed": self.seed, "states": {str(d): g.get_state() for d, g in self._generators.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; generators of devices absent now are recreated when first used."""
        self.seed = int(state["seed"])
        self._generators = {}
        for device, generator_state in state["states"].items():
            self.get(torch.device(device)).set_state(generator_state)


class DPOptimizer(Optimizer):
    """Wraps an optimizer so each ``step`` adds noise to the clipped gradient sum and rescales it.

    ``param_groups``, ``state`` and ``defaults`` are shared with the wrapped optimizer, so learning-rate
    schedulers built on the original keep working, and ``state_dict`` is the original's.

    Args:
        optimizer: the user's optimizer.
        mechanism: the noise mechanism (adds noise to the SUM of clipped per-sample gradients).
        expected_batch_size: ``q N`` (examples per logical step, in expectation); the noisy sum is divided by it.
        generators: the dedicated noise generators.
        on_step: called after each completed step (records the step with the accountant).
        should_skip: called before privatising; when it returns True the step is skipped entirely (budget guard).

    Raises:
        ValueError: non-positive ``expected_batch_size``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        mechanism: NoiseMechanism,
        expected_batch_size: float,
        generators: NoiseGenerators,
        on_step: Callable[[], None] = lambda: None,
        should_skip: Callable[[], bool] = lambda: False,
    ) -> None:
        if not expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be positive, got {expected_batch_size}")
        # Deliberately no Optimizer.__init__: the groups and state are the wrapped optimizer's own objects.
        self.original_optimizer = optimizer
        self.mechanism = mechanism
        self.expected_batch_size = float(expected_batch_size)
        self.generators = generators
        self.on_step = on_step
        self.should_skip = should_skip
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
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

    def privatise(self) -> None:
        """``p.grad <- (p.grad + noise) / (q N)`` for every trainable parameter; a missing grad counts as zero."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad
            grad.add_(self.mechanism.sample(grad, self.generators.get(grad.device)))
            grad.div_(self.expected_batch_size)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (which accumulates the clipped sum), privatise, step the wrapped optimizer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.should_skip():
            return loss
        self.privatise()
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
