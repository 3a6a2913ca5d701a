"""Per-sample momentum over past iterates (Xu et al. 2026, DP-PMLF, Algorithm 1 lines 1, 5 and 6).

For each example ``xi`` of the batch the clipped quantity is its momentum

    v_t(xi) = sum_{i=t-k+1..t} beta^{t-i} / c_beta * grad f_xi(x_i),    c_beta = sum_{i=t-k+1..t} beta^{t-i},

over the ``k`` most recent iterates (weights renormalised over those that exist yet), then ``clip(v_t(xi), C)`` and
the noise once on the sum. Memory: ``k - 1`` copies of the trainable parameters (this rank's shards when sharded);
compute: ``k`` forward and output-gradient passes per batch. Row ``r`` of every re-run must be the same example:
the step may not reorder rows with randomness outside torch's global RNG. How it works, costs and the privacy
argument (accountant unchanged, Theorem 2): docs/design.md section 7 and section 12.4.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_dp.clipping import PerSampleClipper
from lightning_dp.runtime.sharding import gathered_on_cpu, is_sharded, local_part, reshard_all, shard_like


def validate_momentum(momentum_length: int, momentum_beta: float) -> None:
    """Check the per-sample momentum options.

    Raises:
        ValueError: ``momentum_length`` not an integer >= 1, or ``momentum_beta`` not in ``(0, 1]`` (``beta = 1``
            is the equal-weight average, the largest value the paper allows; Lemma 3, remark).
    """
    if isinstance(momentum_length, bool) or not isinstance(momentum_length, int) or momentum_length < 1:
        raise ValueError(
            f"momentum_length must be an integer >= 1 (k, the number of iterates averaged per sample; 1 = no "
            f"momentum), got {momentum_length!r}"
        )
    if isinstance(momentum_beta, bool) or not isinstance(momentum_beta, int | float) or not 0.0 < momentum_beta <= 1.0:
        raise ValueError(
            f"momentum_beta must lie in (0, 1] (the decay of the per-sample momentum weights beta^(t-i); 1 = equal "
            f"weights), got {momentum_beta!r}"
        )


def momentum_weights(available: int, beta: float) -> list[float]:
    """``[beta^0, beta^1, ..., beta^m] / c_beta`` for the current iterate and ``m = available`` past ones.

    Algorithm 1 lines 1 and 5: ``c_beta`` is the sum of the ``beta^j`` used, so the weights sum to one.
    """
    raw = [beta**j for j in range(available + 1)]
    total = sum(raw)
    return [w / total for w in raw]


class PerSampleMomentum:
    """The last ``k - 1`` iterates of the trainable parameters, and the re-runs of a batch at them.

    Args:
        momentum_length: ``k >= 1``; ``1`` keeps nothing and adds nothing (plain DP-SGD).
        momentum_beta: ``beta`` in ``(0, 1]``.

    Raises:
        ValueError: as :func:`validate_momentum`.
    """

    def __init__(self, momentum_length: int, momentum_beta: float) -> None:
        validate_momentum(momentum_length, momentum_beta)
        self.momentum_length = momentum_length
        self.momentum_beta = float(momentum_beta)
        #: newest first: ``history[0]`` is ``x_{t-1}`` at step ``t``.
        self.history: deque[list[torch.Tensor]] = deque(maxlen=momentum_length - 1)
        self._params: list[nn.Parameter] = []
        self._names: list[str] = []
        #: the FSDP2-sharded module the parameters belong to (resharded around each re-run), None unsharded.
        self._sharded_module: nn.Module | None = None
        self._pending: dict[str, Any] | None = None
        #: whether the current batch's past re-runs were abandoned (a step returned ``None``): then the current
        #: iterate alone is the example's quantity, with weight 1.
        self._skipped = False
        #: whether two runs of the user's step on one batch were seen to give the same rows (see ``_check_rows``).
        self._rows_checked = False

    @property
    def enabled(self) -> bool:
        """Whether past iterates are used (``k > 1``)."""
        return self.momentum_length > 1

    def bind(self, clipper: PerSampleClipper) -> None:
        """Track the clipper's trainable parameters (and load a restored state, checking names and shapes); the
        stored iterates are kept when the parameters are the same objects as at the previous bind.

        Raises:
            ValueError: a restored state whose parameters differ from the trainable ones.
        """
        names = {p: name for name, p in clipper.module.named_parameters()}
        params = clipper.trainable_parameters
        if [id(p) for p in params] != [id(p) for p in self._params]:
            self.history.clear()  # another model: its iterates are unrelated (the same one keeps them across fits)
        for iterate in self.history:  # the same model may have moved (``.to(device)``, ``.double()``) between fits
            iterate[:] = [value.to(device=p.device, dtype=p.dtype) for value, p in zip(iterate, params, strict=True)]
        self._params = params
        self._names = [names[p] for p in params]
        self._sharded_module = clipper.module if clipper.sharded else None
        if self._pending is not None:
            state, self._pending = self._pending, None
            self.check_state_dict(state)
            self._restore(state)

    def weights(self) -> list[float]:
        """Weights of the current iterate then of each stored iterate, newest first (they sum to one)."""
        return momentum_weights(len(self.history), self.momentum_beta)

    @property
    def current_weight(self) -> float:
        """``1 / c_beta``, the weight of the current iterate (``1.0`` without stored iterates, or when the batch's
        past re-runs were abandoned)."""
        return 1.0 if self._skipped else self.weights()[0]

    def record(self) -> None:
        """Store the current parameters as an iterate (call right before each optimizer update)."""
        if self.enabled:
            self.history.appendleft([p.detach().clone() for p in self._params])

    @contextmanager
    def _at(self, iterate: list[torch.Tensor]) -> Iterator[None]:
        """Exchange the values of ``iterate`` and of the trainable parameters on entry, and back on exit.

        The exchange is safe because a re-run's graph is built and consumed (its output-gradient pass) inside the
        context, and the current iterate's forward runs after it.
        """
        self._exchange(iterate)
        try:
            yield
        finally:
            self._exchange(iterate)

    @torch.no_grad()
    def _exchange(self, iterate: list[torch.Tensor]) -> None:
        """Exchange the values of ``iterate`` and of the trainable parameters (sharded in place, then resharded)."""
        for param, value in zip(self._params, iterate, strict=True):
            if is_sharded(param):
                shard, stored = local_part(param), local_part(value)
                held = shard.clone()
                shard.copy_(stored)
                stored.copy_(held)
            else:
                param.data, value.data = value.data, param.data
        if self._sharded_module is not None:
            reshard_all(self._sharded_module)

    def add_past_iterates(
        self,
        clipper: PerSampleClipper,
        compute_loss: Callable[[], torch.Tensor | None],
        *,
        stand_in: bool = False,
    ) -> None:
        """Run ``compute_loss`` at each stored iterate and hand its per-sample loss and weight to ``clipper``.

        Call before the current iterate's forward; then ``clipper.backward(loss, weight=self.current_weight)``.

        Args:
            clipper: the clipper the current batch is clipped with (hooks attached).
            compute_loss: ``() -> [B]`` per-sample loss of the CURRENT batch at whatever values the parameters hold;
                ``None`` skips the batch.
            stand_in: the batch is a sharded run's stand-in batch, clipped with weight 0 (the re-runs still run, every
                rank joins their collectives).

        Raises:
            ValueError: on an FSDP2-sharded model, ``compute_loss`` returning ``None`` at a stored iterate.
        """
        weights = [0.0] * (len(self.history) + 1) if stand_in else self.weights()
        devices = sorted({p.device.index or 0 for p in self._params if p.is_cuda})
        self._skipped = False
        if not self._rows_checked:
            self._check_rows(compute_loss, devices)
        for iterate, weight in zip(self.history, weights[1:], strict=True):
            with self._at(iterate), torch.random.fork_rng(devices=devices), torch.enable_grad():
                loss = compute_loss()
                if loss is None:
                    clipper.discard_past_iterates()
                    if clipper.sharded:  # the other ranks would wait for this one in the next re-run's collectives
                        raise ValueError(
                            "training_step returned None at a stored iterate on an FSDP2-sharded model: every rank "
                            "must run every re-run (their forwards gather the weights); return the per-sample loss"
                        )
                    self._skipped = True
                    return
                clipper.add_past_iterate(loss, weight)

    def _check_rows(self, compute_loss: Callable[[], torch.Tensor | None], devices: list[int]) -> None:
        """Once per run: two runs of ``compute_loss`` at the same parameters and RNG state must agree row by row.

        Catches a step that shuffles or pairs rows with another random source (numpy, ``random``, its own generator); a
        row order that depends on the parameters (e.g. sorting by loss) it cannot see.

        Raises:
            ValueError: the two runs differ.
        """
        losses = []
        for _ in range(2):
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                losses.append(compute_loss())
        first, second = losses
        if first is None or second is None or first.numel() == 0:
            return
        if first.shape != second.shape or not torch.allclose(first, second, rtol=1e-5, atol=1e-6):
            raise ValueError(
                "per-sample momentum re-runs your training step on the same batch at past iterates and needs the "
                "same example in the same row every time, but two runs of the step at the same parameters and torch "
                "RNG state gave different per-sample losses: draw any randomness of the step from torch's global RNG "
                "(not numpy, random or your own generator) and do not reorder rows, or use momentum_length=1"
            )
        self._rows_checked = True

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``k``, ``beta`` and the stored iterates as ``[{parameter name: tensor}]``, newest first, in CPU memory.

        On a sharded model a collective (every rank must call it): the iterates are gathered to full values, one at a
        time, and every rank holds the ``k - 1`` full copies in CPU memory until the state is dropped.
        """
        return {
            "momentum_length": self.momentum_length,
            "momentum_beta": self.momentum_beta,
            "iterates": [
                {name: gathered_on_cpu(value) for name, value in zip(self._names, iterate, strict=True)}
                for iterate in self.history
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (now if bound, else at :meth:`bind`) to each parameter's device, dtype and shard
        layout; nothing changes when it raises.

        Raises:
            ValueError: as :meth:`check_state_dict`.
        """
        self.check_state_dict(state)
        if self._params:
            self._restore(state)
        else:
            self._pending = state

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Whether :meth:`load_state_dict` accepts ``state``, without changing anything.

        Raises:
            ValueError: a state that is not :meth:`state_dict`'s structure (iterates that are not dicts of tensors);
                the checkpoint's ``k`` or ``beta`` differ from this run's, or (when bound) its parameters differ from
                the trainable ones.
        """
        iterates = state.get("iterates") if isinstance(state, dict) else None
        if (
            not isinstance(iterates, list)
            or not {"momentum_length", "momentum_beta"} <= set(state)
            or not all(
                isinstance(it, dict) and all(isinstance(t, torch.Tensor) for t in it.values()) for it in iterates
            )
        ):
            raise ValueError(
                "The checkpoint's per-sample momentum state is corrupted (not momentum_length, momentum_beta and "
                "iterates of tensors): resume from an intact checkpoint of this run"
            )
        saved = (state["momentum_length"], state["momentum_beta"])
        if saved != (self.momentum_length, self.momentum_beta):
            raise ValueError(
                f"The checkpoint was trained with momentum_length={saved[0]}, momentum_beta={saved[1]}; this run "
                f"uses {self.momentum_length}, {self.momentum_beta}: resume with the same per-sample momentum"
            )
        if not self._params:
            return
        for saved_iterate in state["iterates"]:
            if list(saved_iterate) != self._names:
                raise ValueError(
                    f"The checkpoint's per-sample momentum iterates hold parameters {list(saved_iterate)}, the "
                    f"trainable parameters are {self._names}: resume with the same model and the same frozen parameters"
                )
            for param, name in zip(self._params, self._names, strict=True):
                if saved_iterate[name].shape != param.shape:
                    raise ValueError(
                        f"The checkpoint's per-sample momentum iterate of '{name}' has shape "
                        f"{tuple(saved_iterate[name].shape)}, the parameter {tuple(param.shape)}"
                    )

    def _restore(self, state: dict[str, Any]) -> None:
        """The checked iterates, each on its parameter's device, dtype and shard (this rank's if sharded)."""
        self.history.clear()
        for saved in state["iterates"]:
            self.history.append(
                [
                    shard_like(saved[name].detach(), param).clone()
                    for param, name in zip(self._params, self._names, strict=True)
                ]
            )
