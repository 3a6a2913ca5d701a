"""Clipping engines: a parameter's terms (one per use) -> its per-sample contribution ``sum_j |grad_ij|^p`` ``[B]``.

The clipper sums the contributions over parameters and takes the ``p``-th root; engines register by name in
:data:`ENGINES` (docs/design.md sections 4.3 and 10.1).
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
        name: registry name (the clipper's ``clipping=``).
        supports_l1: whether ``norm=1`` is available.
        randomized: whether the contribution is a random estimate (needs a generator; accounted by ``rc``, seed
            "Efficient DP-SGD for LLMs with Randomized Clipping", Section 5).
        estimator: a randomized engine's estimator law, one of :data:`~lightning_dp.accounting.rc_envelope.ESTIMATORS`
            (recorded in the privacy event); ``None`` for an exact engine.
        projection_dim: a randomized engine's ``k`` (random projection columns); absent on an exact engine.
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
        """:meth:`contribution` ``[B]``, plus the per-sample gradient summed over uses ``[B, *param.shape]`` when the
        engine formed it and it is no larger than the terms (else None; the default). Book-keeping then uses it for the
        clipped sum (docs/design.md section 4.4).
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
    """:func:`materialised_contribution` and, when no larger than the terms, the per-sample gradient it came from."""
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
    """Class decorator: add an engine class to :data:`ENGINES` under ``cls.name`` (bare, or ``override=True`` to replace
    one, logged). Registering the same class again does nothing.

    Raises:
        ValueError: a randomized engine whose ``estimator`` the ``rc`` accountant does not bound; another class under
            ``cls.name`` without ``override``.
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
    """The values of the ``clipping`` option: :data:`AUTO`, then every engine registered at call time."""
    return (AUTO, *ENGINES)


def auto_engine(norm: int) -> tuple[str, str]:
    """The engine ``clipping="auto"`` runs for the ``norm`` norm, and why (docs/design.md section 4.3).

    Returns:
        ``(name, reason)``: ``"mixed"`` for ``norm=2``, ``"flat"`` for ``norm=1``; never a randomized engine.

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
        projection_dim: ``k`` of a randomized engine (default :data:`DEFAULT_PROJECTION_DIM`); randomized only.

    Raises:
        ValueError: unknown name, ``projection_dim < 1``, or ``projection_dim`` for a deterministic engine.
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
