"""The noise-mechanism interface and the registry of mechanisms by name.

A mechanism adds noise ONCE per optimizer step to the SUM of clipped per-sample gradients (docs/design.md section 3.4),
knows the norm its sensitivity is measured in (``clip_norm``: 2 or 1), emits the privacy event of one step
for its accountant, and states its expected per-coordinate distortion ``E|z|``.

The mechanism classes import torch only where they draw noise (:mod:`~lightning_dp.mechanisms.sampling` and
:mod:`~lightning_dp.mechanisms.secure`), so the registry, calibration and accounting load without it (``lightning-dp
epsilon`` and ``calibrate`` never import torch).
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, overload

from lightning_dp.mechanisms.solver import CalibrationProblem, CalibrationResult, calibrate_parameter
from lightning_dp.registration import Registry, class_decorator

if TYPE_CHECKING:
    import torch

#: The mechanisms by ``name`` (read it as a dict; add with :func:`register_mechanism`, remove with ``remove``).
MECHANISMS: Registry[str, type[NoiseMechanism]] = Registry("mechanism", option="noise")

_M = TypeVar("_M", bound="type[NoiseMechanism]")


@overload
def register_mechanism(cls: _M, /, *, override: bool = False) -> _M: ...
@overload
def register_mechanism(cls: None = None, /, *, override: bool = False) -> Callable[[_M], _M]: ...
def register_mechanism(cls: _M | None = None, /, *, override: bool = False) -> _M | Callable[[_M], _M]:
    """Class decorator: make a mechanism constructible by its ``name``. Use it bare (``@register_mechanism``), or as
    ``@register_mechanism(override=True)`` / ``register_mechanism(cls, override=True)`` to replace the mechanism
    registered under that name (logged as a warning). Registering the same class again does nothing.

    Raises:
        ValueError: another class is registered under ``cls.name`` and ``override`` is False.
    """
    return class_decorator(cls, lambda cls: MECHANISMS.register(cls.name, cls, override=override))


def mechanism_class(name: str) -> type[NoiseMechanism]:
    """The registered mechanism class called ``name``. Raises ``ValueError`` listing the valid names."""
    return MECHANISMS.get(name)


def make_mechanism(name: str, **params: Any) -> NoiseMechanism:
    """Build a registered mechanism, e.g. ``make_mechanism("gaussian", noise_multiplier=1.1, max_grad_norm=1.0)``.

    Raises:
        ValueError: unknown name (the message lists the valid ones), a parameter the mechanism does not take (e.g.
            ``noise_scale`` for ``"gaussian"``), or invalid parameter values.
    """
    cls = mechanism_class(name)
    accepted = inspect.signature(cls).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        foreign = sorted(set(params) - set(accepted))
        if foreign:
            raise ValueError(
                f"{', '.join(foreign)} does not apply to noise={name!r}, which takes {', '.join(accepted)}"
            )
    return cls(**params)


def secure_mechanisms() -> tuple[str, ...]:
    """The registered mechanisms with a hardened sampler (``supports_secure``), in registration order."""
    return tuple(name for name, cls in MECHANISMS.items() if cls.supports_secure)


def secure_mode_unsupported(name: str) -> str:
    """The error message for ``secure_mode`` with a mechanism that has no hardened sampler."""
    return f"secure_mode=True has samplers for noise in {secure_mechanisms()}, not {name!r}"


def check_positive(name: str, value: float, hint: str = "") -> float:
    """Return ``float(value)`` or raise ``ValueError`` unless it is positive and finite.

    Args:
        name: the parameter name, used in the message.
        value: the value to check.
        hint: an extra sentence telling the user how to pick a valid value.
    """
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value}. {hint}".rstrip())
    return float(value)


def validate_max_grad_norm(max_grad_norm: float) -> None:
    """Raise ``ValueError`` unless the clipping bound is positive and finite."""
    if not (max_grad_norm > 0 and max_grad_norm < float("inf")):
        raise ValueError(f"max_grad_norm must be a positive finite number, got {max_grad_norm}; e.g. 1.0 (the default)")


class NoiseMechanism(ABC):
    """Noise added to the sum of clipped per-sample gradients.

    Attributes:
        name: registry name, the ``noise=`` argument of ``DPStrategy``.
        clip_norm: the norm per-sample gradients are clipped in (2, or 1 for traditional Laplace).
        default_accountant: the sound accountant used when the user names none.
        max_grad_norm: the clipping bound C (sensitivity of the sum under add/remove-one).

    Calibration (``calibrate(noise=name, ...)``, :mod:`lightning_dp.mechanisms.calibration`) reads the class: by
    default it solves for the one constructor argument ``calibrated_parameter`` at fixed ``C``
    (:func:`~lightning_dp.mechanisms.solver.calibrate_parameter`); a mechanism with its own search overrides
    :meth:`calibrate`.
    """

    name: ClassVar[str]
    clip_norm: ClassVar[int] = 2
    default_accountant: ClassVar[str]
    #: The accountant a calibration targets when none is named (``None``: ``default_accountant``).
    calibration_accountant: ClassVar[str | None] = None
    #: True when the privacy event depends on the number of noised coordinates (``num_params`` is then required).
    needs_num_params: ClassVar[bool] = False
    #: The constructor argument :meth:`calibrate` solves for (``None``: no single calibrated parameter).
    calibrated_parameter: ClassVar[str | None] = None
    #: True if epsilon increases with the calibrated parameter (an inverse scale), False if it decreases (a scale).
    epsilon_increases: ClassVar[bool] = False
    #: The range the calibrated parameter is searched in.
    parameter_bounds: ClassVar[tuple[float, float]] = (1e-12, 1e12)
    #: One-line help of each noise parameter (constructor argument), for the command line.
    parameter_help: ClassVar[dict[str, str]] = {}
    #: Accountants reported next to ``default_accountant`` when none is named (e.g. a paper's bound), shown first.
    comparison_accountants: ClassVar[tuple[str, ...]] = ()
    #: Name of the mechanism's joint search over the clipping bound (:meth:`search_clipping`), or ``None``.
    clip_search: ClassVar[str | None] = None
    #: True when :meth:`secure_sample` has a sampler hardened against floating-point attacks (``secure_mode``).
    supports_secure: ClassVar[bool] = False
    #: True when :meth:`sample` draws every coordinate independently, with nothing shared within a call (unlike
    #: PLRV-O's scale, drawn once per call): a tensor may then be noised piece by piece
    #: (:func:`~lightning_dp.mechanisms.sampling.add_in_pieces`), each piece from its own call. Not inherited: a
    #: subclass states it in its own body (:meth:`__init_subclass__`).
    piecewise: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every class opts in to :attr:`piecewise` itself: a subclass of a piecewise mechanism whose ``sample`` shares
        a draw within a call must not inherit it."""
        super().__init_subclass__(**kwargs)
        cls.piecewise = cls.__dict__.get("piecewise", False)

    def __init__(self, max_grad_norm: float) -> None:
        validate_max_grad_norm(max_grad_norm)
        self.max_grad_norm = float(max_grad_norm)

    @abstractmethod
    def sample(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Noise of ``like``'s shape, dtype and device, drawn from ``generator`` (on that device).

        The coordinates must be i.i.d. draws of the mechanism's one-coordinate law, whatever the shape: a sharded
        gradient is noised shard by shard (:mod:`lightning_dp.runtime.sharding`), each shard from its own stream."""

    def secure_sample(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The noise of :meth:`sample` (same law) drawn with the hardened samplers of
        :mod:`lightning_dp.mechanisms.secure` (``secure_mode``); overridden where ``supports_secure`` is True.

        Raises:
            ValueError: the mechanism has no hardened sampler.
        """
        raise ValueError(secure_mode_unsupported(self.name))

    @abstractmethod
    def step_event(self, sample_rate: float, num_params: int) -> Any:
        """The privacy event of one Poisson-subsampled step over ``num_params`` noised coordinates."""

    @abstractmethod
    def expected_abs_noise(self) -> float:
        """Per-coordinate distortion ``E|z|`` of one draw (same units as the gradient sum)."""

    @property
    def is_noiseless(self) -> bool:
        """True when the mechanism adds no noise (then no finite epsilon holds)."""
        return False

    def describe(self) -> dict[str, float]:
        """The mechanism's constructor arguments (``make_mechanism(name, **describe())`` rebuilds it), for logs,
        summaries and checkpoints."""
        return {"max_grad_norm": self.max_grad_norm}

    @classmethod
    def noise_parameters(cls) -> tuple[str, ...]:
        """The constructor arguments that set the noise (all but ``max_grad_norm``), in signature order."""
        return tuple(p for p in inspect.signature(cls).parameters if p != "max_grad_norm")

    # ------------------------------------------------------------------------------------------------ calibration

    @classmethod
    def from_parameter(cls, value: float, *, max_grad_norm: float) -> NoiseMechanism:
        """The mechanism with ``calibrated_parameter = value`` and clipping bound ``max_grad_norm``."""
        parameter = cls.calibrated_parameter
        assert parameter is not None, f"{cls.__name__} has no calibrated_parameter"
        return cls(**{parameter: value, "max_grad_norm": max_grad_norm})

    @classmethod
    def calibration_start(cls, problem: CalibrationProblem) -> tuple[float, float]:
        """``(initial, growth)`` of the root finder: the first value tried and the bracket's growth factor.

        Default: the LAP2 seed's closed form ``(2 q / eps) sqrt(T log(1/delta))`` (the right order of magnitude for
        a noise multiplier), growth 2.
        """
        return problem.noise_ratio(), 2.0

    @classmethod
    def calibrate(cls, problem: CalibrationProblem) -> CalibrationResult:
        """This mechanism calibrated for ``problem`` (its accountant already resolved, ``num_params`` checked).

        Default: one monotone root finding over ``calibrated_parameter``
        (:func:`~lightning_dp.mechanisms.solver.calibrate_parameter`).

        Raises:
            ValueError: no calibrated parameter, or an unreachable target.
        """
        if cls.calibrated_parameter is None:
            raise ValueError(f"No calibration for noise={cls.name!r}; choose one of {sorted(MECHANISMS)}")
        return calibrate_parameter(cls, problem)

    @classmethod
    def search_clipping(cls, problem: CalibrationProblem) -> CalibrationResult:
        """The mechanism's own search over the clipping bound (``clip_search``, e.g. LAP2 / PLRV-O Alg. 1), with
        ``problem.max_grad_norm`` the largest bound considered.

        Raises:
            ValueError: the mechanism has no such search.
        """
        raise ValueError(f"noise={cls.name!r} has no search over the clipping bound")
