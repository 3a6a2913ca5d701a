"""Low-pass filter of the noisy gradient with bias correction (Xu et al. 2026, DP-PMLF, Algorithm 1 lines 9-11).

The released noisy average ``vbar_t`` of each step is filtered, in the sign convention of line 9::

    m_t     = - sum_{r=1..na} a_r m_{t-r}     + sum_{r=0..nb} b_r vbar_{t-r}          (line 9)
    c_{m,t} = - sum_{r=1..na} a_r c_{m,t-r}   + sum_{r=0..nb} b_r c_{b,t-r},  c_b = 1 (line 10)
    mhat_t  = m_t / c_{m,t}                                                           (line 11)

with every term of index ``< 0`` zero; this is ``scipy.signal.lfilter(b, [1, *a], x)``. Constraint (3), ``-sum a +
sum b = 1``, is unit gain at zero frequency. With momentum off it is LP-DPSGD (Zhang et al. 2024). Post-processing:
no privacy cost (docs/design.md section 7). Memory: ``na + nb`` copies of the trainable parameters' gradients.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import scipy.signal
import torch

from lightning_dp.runtime.sharding import gathered_on_cpu, shard_like

#: Tolerance of constraint (3).
CONSTRAINT_TOLERANCE = 1e-9
#: ``|c_{m,t}|`` below this makes ``mhat_t = m_t / c_{m,t}`` numerically meaningless.
MIN_BIAS_CORRECTION = 1e-6

#: Named coefficient sets ``{"a": [a_1..a_na], "b": [b_0..b_nb]}`` in the sign convention of line 9.
#: The ``pmlf-*`` sets are the coefficient files of the DP-PMLF authors' released code
#: (github.com/Philosophy3290/DP-PMLF, ``coefs/<name>.csv`` at commit 8329d3b: first line ``1, a_1, ...``, second
#: line ``b_0, ...``; its README runs MNIST with ``a9b1``); their code says it reuses DOPPLER's (LP-DPSGD, Zhang et
#: al. 2024a), whose own tables we could not check. The seed paper does not say which set each experiment used. The
#: other three are textbook designs of the same family (unit DC gain, poles inside the unit circle).
LOWPASS_PRESETS: dict[str, dict[str, tuple[float, ...]]] = {
    # First-order IIR, pole 0.9: an exponential moving average of the noisy gradient; with the bias correction this
    # is the bias-corrected EMA of Adam's first moment (c_{m,t} = 1 - 0.9^(t+1)). The same set as pmlf-a9b1.
    "ema": {"a": (-0.9,), "b": (0.1,)},
    # First-order IIR, pole 0.9, zero at z = -1: removes the highest frequency (period-2 noise) entirely. The same
    # set as pmlf-a9b0505.
    "first-order": {"a": (-0.9,), "b": (0.05, 0.05)},
    # Second-order IIR, double pole 0.8, double zero at z = -1 (critically damped, no overshoot in the step response).
    "second-order": {"a": (-1.6, 0.64), "b": (0.01, 0.02, 0.01)},
    "pmlf-a9b1": {"a": (-0.9,), "b": (0.1,)},
    "pmlf-a9b0505": {"a": (-0.9,), "b": (0.05, 0.05)},
    "pmlf-a9b1505": {"a": (-0.9,), "b": (0.15, -0.05)},
    "pmlf-a6b4": {"a": (-0.6,), "b": (0.4,)},
    "pmlf-a6b0202": {"a": (-0.6,), "b": (0.2, 0.2)},
    "pmlf-a6b0501": {"a": (-0.6,), "b": (0.5, -0.1)},
    "pmlf-a72b0505": {"a": (-0.7, -0.2), "b": (0.05, 0.05)},
}


def _coefficients(values: Sequence[float], name: str) -> tuple[float, ...]:
    try:
        result = tuple(float(v) for v in values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"lowpass coefficients {name!r} must be a list of numbers, got {values!r}") from error
    if not all(math.isfinite(v) for v in result):
        raise ValueError(f"lowpass coefficients {name!r} must be finite, got {list(result)}")
    return result


class LowPassFilter:
    """IIR low-pass filter with bias correction of the noisy gradients, one step per call of :meth:`apply_`.

    Args:
        a: feedback coefficients ``[a_1, ..., a_na]`` (may be empty: an FIR filter), sign convention of Algorithm 1
            line 9 (``m_t = -sum a_r m_{t-r} + ...``).
        b: feed-forward coefficients ``[b_0, ..., b_nb]`` (at least one).
        name: a label for summaries (the preset name, or ``"custom"``).

    Raises:
        ValueError: non-numeric or non-finite coefficients, empty ``b``; constraint (3) ``-sum a + sum b = 1``
            violated by more than 1e-9; a pole of ``1 + sum a_r z^-r`` on or outside the unit circle (unstable);
            a bias correction ``c_{m,t}`` that vanishes (e.g. ``b_0 = 0``), where ``m_t / c_{m,t}`` is undefined.
    """

    def __init__(self, a: Sequence[float], b: Sequence[float], *, name: str = "custom") -> None:
        self.a = _coefficients(a, "a")
        self.b = _coefficients(b, "b")
        self.name = name
        if not self.b:
            raise ValueError("lowpass coefficients 'b' must hold at least b_0")
        gain = -sum(self.a) + sum(self.b)
        if abs(gain - 1.0) > CONSTRAINT_TOLERANCE:
            raise ValueError(
                f"lowpass coefficients violate constraint (3) of DP-PMLF, -sum(a) + sum(b) = 1 (unit gain at zero "
                f"frequency): here -sum(a) + sum(b) = {gain:.12g}. Multiply b by (1 + sum(a)) / sum(b) = "
                f"{(1 + sum(self.a)) / sum(self.b) if sum(self.b) else float('nan'):.12g} to satisfy it"
            )
        poles = np.roots([1.0, *self.a]) if self.a else np.zeros(0)
        radius = float(np.abs(poles).max()) if poles.size else 0.0
        if radius >= 1.0:
            raise ValueError(
                f"lowpass filter is unstable: 1 + sum_r a_r z^-r has a pole of modulus {radius:.6g} (poles "
                f"{np.round(poles, 6).tolist()}); every pole must lie strictly inside the unit circle"
            )
        corrections = self.bias_corrections(self._settling_steps(radius))
        vanishing = np.flatnonzero(np.abs(corrections) < MIN_BIAS_CORRECTION)
        if vanishing.size:
            raise ValueError(
                f"lowpass bias correction c_m,t = {corrections[vanishing[0]]:.3g} vanishes at step t = "
                f"{int(vanishing[0])}, so mhat_t = m_t / c_m,t is undefined (Algorithm 1 line 11); use b_0 != 0"
            )
        self._m: list[list[torch.Tensor]] = []  # m_{t-1}, m_{t-2}, ... (at most na)
        self._vbar: list[list[torch.Tensor]] = []  # vbar_{t-1}, ... (at most nb)
        self._c_m: list[float] = []  # c_{m,t-1}, ... (at most na)
        self._restored = False  # history read from a checkpoint, not yet laid out like the gradients
        self.steps = 0

    def _settling_steps(self, radius: float) -> int:
        """Steps after which the step response is within 1e-12 of its limit (plus the FIR part)."""
        tail = 0 if radius == 0.0 else math.ceil(math.log(1e-12) / math.log(radius))
        return min(len(self.b) + tail, 100_000)

    def bias_corrections(self, steps: int) -> np.ndarray:
        """``c_{m,0..steps-1}`` of Algorithm 1 line 10 (the response to a unit step), shape ``[steps]``."""
        return scipy.signal.lfilter(self.b, [1.0, *self.a], np.ones(steps))

    def describe(self) -> dict[str, Any]:
        """``{"name", "a", "b"}`` for summaries and logs."""
        return {"name": self.name, "a": list(self.a), "b": list(self.b)}

    @torch.no_grad()
    def apply_(self, grads: Sequence[torch.Tensor]) -> None:
        """One filter step: replace each ``grads[i]`` (the noisy average ``vbar_t`` of parameter i, any shape and
        device) in place by ``mhat_t``; the state advances by one step.

        Raises:
            ValueError: the number or shapes of the tensors differ from the previous steps' (e.g. the filter is
                shared by two optimizers).
        """
        self._check_layout(grads)
        if self._restored:
            self._lay_out_like(grads)
            self._restored = False
        m = [g.mul(self.b[0]) for g in grads]
        for b_r, past in zip(self.b[1:], self._vbar, strict=False):
            for m_i, v_i in zip(m, past, strict=True):
                m_i.add_(v_i, alpha=b_r)
        for a_r, past in zip(self.a, self._m, strict=False):
            for m_i, p_i in zip(m, past, strict=True):
                m_i.add_(p_i, alpha=-a_r)
        c_m = -sum(a_r * c for a_r, c in zip(self.a, self._c_m, strict=False)) + sum(self.b[: self.steps + 1])
        if len(self.b) > 1:
            self._vbar = [[g.detach().clone() for g in grads], *self._vbar][: len(self.b) - 1]
        if self.a:
            self._m = [m, *self._m][: len(self.a)]
            self._c_m = [c_m, *self._c_m][: len(self.a)]
        for g, m_i in zip(grads, m, strict=True):
            g.copy_(m_i).div_(c_m)
        self.steps += 1

    def _lay_out_like(self, grads: Sequence[torch.Tensor]) -> None:
        """Give the restored history the gradients' layout (once, at the first step after :meth:`load_state_dict`):
        their device and dtype, and on a sharded model this rank's shard of the full tensors a checkpoint holds
        (:func:`~lightning_dp.runtime.sharding.shard_like`). The history the filter forms itself has that layout
        already."""
        self._m = [[shard_like(p, g) for p, g in zip(lag, grads, strict=True)] for lag in self._m]
        self._vbar = [[shard_like(v, g) for v, g in zip(lag, grads, strict=True)] for lag in self._vbar]

    def _check_layout(self, grads: Sequence[torch.Tensor]) -> None:
        past = self._m[0] if self._m else self._vbar[0] if self._vbar else None
        if past is None:
            return
        if [tuple(p.shape) for p in past] != [tuple(g.shape) for g in grads]:
            raise ValueError(
                f"lowpass filter got {len(grads)} gradients of shapes {[tuple(g.shape) for g in grads]} after "
                f"{[tuple(p.shape) for p in past]} at the previous step: one filter serves one optimizer's "
                "trainable parameters"
            )

    def state_dict(self) -> dict[str, Any]:
        """Coefficients, step count, past ``m``, past ``vbar`` (lists of tensors, most recent first) and past
        ``c_m``. All are functions of released noisy gradients, so they may be checkpointed. The tensors are returned
        in CPU memory; on a sharded model they are gathered to their full values one at a time (a collective: every
        rank must call this), so that one file holds them and any rank can take its shard back (:meth:`apply_` does,
        after :meth:`load_state_dict`)."""
        return {
            "a": list(self.a),
            "b": list(self.b),
            "steps": self.steps,
            "m": [[gathered_on_cpu(t) for t in lag] for lag in self._m],
            "vbar": [[gathered_on_cpu(t) for t in lag] for lag in self._vbar],
            "c_m": list(self._c_m),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the tensors take the gradients' device, dtype and sharding at the next step).

        Raises:
            ValueError: as :meth:`check_state_dict` (nothing changes then).
        """
        self.check_state_dict(state)
        self.steps = int(state["steps"])
        self._m = [list(lag) for lag in state["m"]]
        self._vbar = [list(lag) for lag in state["vbar"]]
        self._c_m = [float(c) for c in state["c_m"]]
        self._restored = True

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Whether :meth:`load_state_dict` accepts ``state``, without changing anything.

        Raises:
            ValueError: the saved coefficients differ from this filter's (resume with the same ``lowpass``), or the
                saved history does not fit them or is not made of tensors and numbers (a damaged checkpoint).
        """
        if not _well_formed(state):
            raise ValueError(
                "The checkpoint's lowpass state is damaged: it is not a filter's state (a, b, steps, m, vbar, c_m); "
                "resume from an intact checkpoint"
            )
        saved = (tuple(float(v) for v in state["a"]), tuple(float(v) for v in state["b"]))
        if saved != (self.a, self.b):
            raise ValueError(
                f"The checkpoint's lowpass filter a={list(saved[0])}, b={list(saved[1])} differs from this run's "
                f"a={list(self.a)}, b={list(self.b)}; resume with the same lowpass"
            )
        steps, lags = int(state["steps"]), (len(state["m"]), len(state["vbar"]), len(state["c_m"]))
        expected = (min(steps, len(self.a)), min(steps, len(self.b) - 1), min(steps, len(self.a)))
        if steps < 0 or lags != expected:
            raise ValueError(
                f"The checkpoint's lowpass state is damaged: after {steps} steps it holds {lags} past (m, vbar, c_m), "
                f"the filter keeps {expected}; resume from an intact checkpoint"
            )

    def __repr__(self) -> str:
        return f"LowPassFilter(name={self.name!r}, a={list(self.a)}, b={list(self.b)})"


def _well_formed(state: Any) -> bool:
    """Whether ``state`` has the entries and element types :meth:`LowPassFilter.state_dict` writes: finite numbers,
    and past ``m`` and ``vbar`` that each hold tensors of the same shapes (one per parameter)."""

    def numbers(values: Any) -> bool:
        return isinstance(values, list | tuple) and all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values
        )

    def history(lags: Any) -> bool:
        return isinstance(lags, list | tuple) and all(
            isinstance(lag, list | tuple) and all(isinstance(t, torch.Tensor) for t in lag) for lag in lags
        )

    if not (
        isinstance(state, Mapping)
        and {"a", "b", "steps", "m", "vbar", "c_m"} <= state.keys()
        and numbers(state["a"])
        and numbers(state["b"])
        and numbers(state["c_m"])
        and isinstance(state["steps"], int)
        and not isinstance(state["steps"], bool)
        and history(state["m"])
        and history(state["vbar"])
    ):
        return False
    layouts = {tuple(tuple(t.shape) for t in lag) for lag in [*state["m"], *state["vbar"]]}
    return len(layouts) <= 1


def make_lowpass(spec: None | str | Mapping[str, Sequence[float]] | LowPassFilter) -> LowPassFilter | None:
    """The filter described by ``spec``: ``None`` (no filter), a preset name of :data:`LOWPASS_PRESETS`, a dict
    ``{"a": [a_1, ..., a_na], "b": [b_0, ..., b_nb]}`` (free coefficients, sign convention of Algorithm 1 line 9), or
    a ready :class:`LowPassFilter` (returned as is).

    Raises:
        ValueError: an unknown preset name (the message lists the presets), a dict with other keys than ``a`` and
            ``b``, any other type, or coefficients the filter rejects (see :class:`LowPassFilter`).
    """
    if spec is None or isinstance(spec, LowPassFilter):
        return spec
    if isinstance(spec, str):
        if spec not in LOWPASS_PRESETS:
            raise ValueError(
                f"Unknown lowpass preset {spec!r}; choose one of {sorted(LOWPASS_PRESETS)} or give the coefficients "
                'as {"a": [a_1, ...], "b": [b_0, ...]}'
            )
        preset = LOWPASS_PRESETS[spec]
        return LowPassFilter(preset["a"], preset["b"], name=spec)
    if isinstance(spec, Mapping):
        if set(spec) - {"a", "b"} or "b" not in spec:
            raise ValueError(
                f'lowpass coefficients must be {{"a": [a_1, ...], "b": [b_0, ...]}}, got keys {sorted(spec)}'
            )
        return LowPassFilter(spec.get("a", ()), spec["b"])
    raise ValueError(f"lowpass must be None, a preset name, or a dict of coefficients, got {type(spec).__name__}")
