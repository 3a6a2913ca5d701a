"""Clipping engines: how the per-sample norm contribution of one parameter is computed from its terms.

An engine maps the terms of one parameter (one per use of it in the forward pass) to ``sum_j |grad_ij|^p``, a
``[B]`` tensor, for the clipping norm ``p`` (2 or 1). The clipper sums these over parameters and takes the ``p``-th
root. Engine classes register themselves by name in :data:`ENGINES`; a new engine is one new file.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar, overload

import torch

from lightning_dp.clipping.terms import Materialised, Term, materialise_sum, term_elements
from lightning_dp.registration import Registry, class_decorator

#: Default number of projection columns ``k`` of the randomized engines (seed DP-SGD-RC, Algorithm 2).
DEFAULT_PROJECTION_DIM = 32


class ClippingEngine(ABC):
    """Computes per-sample norm contributions of one parameter.

    Attributes:
        name: registry name (the ``clipping=`` argument of the clipper).
        supports_l1: whether ``norm=1`` is available (it needs the per-sample gradients themselves).
        randomized: whether the contribution is a random estimate (it then needs a generator and changes the
            privacy accounting: seed "Efficient DP-SGD for LLMs with Randomized Clipping", Section 5).
        estimator: for a randomized engine, the law of its estimate that the ``rc`` accountant bounds, one of
            :data:`~lightning_dp.accounting.rc_envelope.ESTIMATORS` (``"hutch"``: Hutchinson's, ``"hutchpp"``:
            Hutch++); recorded in the privacy event in place of the engine's name, so a new engine with one of
            these laws is accounted without naming it anywhere else. ``None`` for an exact engine.
        projection_dim: for a randomized engine, ``k``, the number of random projection columns (its constructor
            receives it); absent on an exact engine.
    """

    name: ClassVar[str]
    supports_l1: ClassVar[bool] = False
    randomized: ClassVar[bool] = False
    estimator: ClassVar[str | None] = None
    projection_dim: int

    @abstractmethod
    def contribution(self, terms: list[Term], norm: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``sum_j |g_ij|^norm`` for ``g_i`` the per-sample gradient summed over all ``terms`` (uses): ``[B]``.

        Args:
            terms: one term per use of the parameter (at least one), all with the same batch size ``B``.
            norm: 2 (squared l2 norm) or 1 (l1 norm; only when ``supports_l1``).
            generator: the source of randomness of a randomized engine, on the terms' device (ignored otherwise).
        """

    def contribution_and_gradient(
        self, terms: list[Term], norm: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`contribution` ``[B]``, plus the per-sample gradient summed over the uses ``[B, *param.shape]``
        when the engine formed it in full and it holds no more elements than the terms it stands for (else None).

        Book-keeping then forms the clipped sum ``sum_i c_i g_i`` from it (``B * numel`` multiply-adds) instead of
        ``sum_i c_i L_i^T R_i`` from the factors (``B * T * numel``). When every parameter of a group of captures
        is kept this way, the captures are released, so the kept gradients take at most the factors' memory;
        otherwise the captures live until the clipped sum and the kept gradients come on top. The default forms
        nothing (None).
        """
        return self.contribution(terms, norm, generator), None


def materialised_contribution(terms: Sequence[Term], norm: int) -> torch.Tensor:
    """Exact contribution from the materialised per-sample gradient (memory ``B * param.numel()``)."""
    return gradient_contribution(materialise_sum(terms), norm)


def gradient_contribution(grad: torch.Tensor, norm: int) -> torch.Tensor:
    """``sum_j |g_ij|^norm`` ``[B]`` of per-sample gradients ``grad`` ``[B, ...]`` (norm 1 or 2)."""
    flat = grad.flatten(1)
    return flat.abs().sum(1) if norm == 1 else flat.square().sum(1)


def materialised_contribution_and_gradient(
    terms: Sequence[Term], norm: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`materialised_contribution` and, when it is no larger than the terms (see
    :meth:`ClippingEngine.contribution_and_gradient`), the per-sample gradient it was computed from."""
    grad = materialise_sum(terms)
    return gradient_contribution(grad, norm), grad if gradient_fits(terms) else None


def gradient_fits(terms: Sequence[Term]) -> bool:
    """Whether the per-sample gradient ``[B, *param.shape]`` of ``terms`` holds no more elements than the terms."""
    first = terms[0]
    size = first.grad.numel() if isinstance(first, Materialised) else first.right.shape[0] * math.prod(first.shape)
    return size <= sum(term_elements(term) for term in terms)


#: The engines by ``name`` (read it as a dict; add with :func:`register_engine`, remove with ``remove``).
ENGINES: Registry[str, type[ClippingEngine]] = Registry("clipping engine", option="clipping")

_E = TypeVar("_E", bound=type[ClippingEngine])


@overload
def register_engine(cls: _E, /, *, override: bool = False) -> _E: ...
@overload
def register_engine(cls: None = None, /, *, override: bool = False) -> Callable[[_E], _E]: ...
def register_engine(cls: _E | None = None, /, *, override: bool = False) -> _E | Callable[[_E], _E]:
    """Class decorator: add an engine class to :data:`ENGINES` under ``cls.name``. Use it bare (``@register_engine``),
    or as ``@register_engine(override=True)`` / ``register_engine(cls, override=True)`` to replace the engine
    registered under that name (logged as a warning). Registering the same class again does nothing.

    Raises:
        ValueError: a randomized engine whose ``estimator`` is not one the ``rc`` accountant bounds; another class
            registered under ``cls.name`` and ``override`` False.
    """
    return class_decorator(cls, lambda cls: ENGINES.register(cls.name, _checked(cls), override=override))


def _checked(cls: type[ClippingEngine]) -> type[ClippingEngine]:
    """``cls``, after checking that a randomized engine names an estimator the ``rc`` accountant bounds."""
    from lightning_dp.accounting.rc_envelope import ESTIMATORS

    if cls.randomized and cls.estimator not in ESTIMATORS:
        raise ValueError(
            f"randomized engine {cls.name!r} must set estimator to one of {ESTIMATORS} (the law of its norm estimate "
            f"that the rc accountant bounds), got {cls.estimator!r}"
        )
    return cls


#: The ``clipping`` value that lets the library pick the engine (:func:`auto_engine`); not an engine itself.
AUTO = "auto"


def clipping_choices() -> tuple[str, ...]:
    """The values the ``clipping`` option takes: :data:`AUTO`, then every registered engine (read at call time, so
    engines registered by extensions are included)."""
    return (AUTO, *ENGINES)


def auto_engine(norm: int) -> tuple[str, str]:
    """The engine ``clipping="auto"`` runs when per-sample gradients are clipped in the ``norm`` norm, and why.

    Returns:
        ``(name, reason)``: for l2 (``norm=2``) ``"mixed"``, which takes per parameter the cheaper of ghost norms and
        materialised per-sample gradients, and with book-keeping reuses the materialised ones for the clipped sum:
        the fastest exact engine, or within the measurement's noise of it, at every shape of docs/performance.md
        (tiny GPT-2 at T = 128, 512, 2048; a 128k-token head); for l1 (``norm=1``, ``noise="laplace"``) ``"flat"``,
        the only engine that supports it. Every exact engine gives the same clipped sum up to float rounding, so
        the choice changes the cost only; a randomized engine (``hutch``, ``hutchpp``) is never picked, since its
        norm estimate changes the accounting.

    Raises:
        ValueError: ``norm`` other than 1 or 2.
    """
    if norm == 2:
        return "mixed", "the fastest exact engine for an l2 mechanism"
    if norm == 1:
        return "flat", "the only engine that clips in l1 norm, for an l1 mechanism"
    raise ValueError(f"norm must be 1 or 2, got {norm!r}")


def make_clipping_engine(name: str, *, projection_dim: int | None = None) -> ClippingEngine:
    """Build the engine registered as ``name``.

    Args:
        name: one of :data:`ENGINES`.
        projection_dim: ``k``, the number of random projection columns of a randomized engine (default
            :data:`DEFAULT_PROJECTION_DIM`); only for randomized engines.

    Raises:
        ValueError: unknown name, ``projection_dim < 1``, or ``projection_dim`` given for a deterministic engine.
    """
    cls = ENGINES.get(name)
    if not cls.randomized:
        if projection_dim is not None:
            randomized = ", ".join(n for n, engine in ENGINES.items() if engine.randomized)
            raise ValueError(f"projection_dim applies to the randomized engines ({randomized}), not {name!r}")
        return cls()
    k = DEFAULT_PROJECTION_DIM if projection_dim is None else int(projection_dim)
    if k < 1:
        raise ValueError(f"projection_dim must be a positive integer, got {projection_dim!r}")
    return cls(projection_dim=k)  # type: ignore[call-arg]
