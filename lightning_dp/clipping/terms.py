"""Per-sample gradient terms: what a layer family hands to a clipping engine (docs/design.md section 4.2).

A term holds one use's per-sample gradient in full (:class:`Materialised`) or factored as ``grad_i = L_i^T R_i``
(:class:`Factored`), whose norm the ghost engine takes as ``<L_i L_i^T, R_i R_i^T>`` (Li et al. 2022, "Large
language models can be strong differentially private learners", Section 4).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeGuard, cast

import torch
from torch import nn

from lightning_dp.clipping.rows import active_only, active_rows, zero_rows_

#: Whether a factor may be overwritten in place: a tensor of the clipper's own (e.g. a captured output gradient),
#: which nothing reads after the clipped sum; an activation, a parameter or a user's tensor is never writable.
Writable = Callable[[torch.Tensor], bool]


def scaled(x: torch.Tensor, scale: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """``x * scale``, in place when ``x`` is a copy made for the sum (not ``original``, the term's own factor, which
    another term may share)."""
    return x.mul_(scale) if x is not original else x * scale


def finite(x: torch.Tensor, writable: Writable, squares: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[B, ...]`` with its non-finite entries set to 0: in place when ``writable(x)`` and ``x`` is contiguous
    (no two elements share memory), else in a copy (``nan_to_num``). Only a dropped sample has non-finite entries (they
    make its norm non-finite, docs/design.md section 9.2), so every other entry keeps its bits, and which samples were
    dropped decides no value (on the CPU, only how many rows a write touches).

    In place with ``squares`` ``[B, T]`` for ``x`` ``[B, T, n]``, the squared row norms a Gram matrix's diagonal gave
    (:meth:`Factored.note_factor_squares`): the whole rows whose squared norm is not finite are zeroed instead
    (:func:`~lightning_dp.clipping.rows.zero_rows_`: on the CPU a write of those rows alone, elsewhere one read and one
    write of ``x``, cheaper than ``nan_to_num_``). Such a row holds every non-finite entry, and only a dropped sample
    has one (its norm is not finite either), or is a finite row whose other factor's row is 0 (left out of the norm,
    :attr:`Factored.active`), whose products are 0 either way: the same sum wherever the weight is not 0.

    Raises:
        ValueError: ``squares`` is not ``[B, T]`` for ``x`` ``[B, T, n]``.
    """
    if writable(x) and x.is_contiguous():
        if squares is None:
            return x.nan_to_num_(0.0, 0.0, 0.0)
        if x.ndim != 3 or squares.shape != x.shape[:2]:
            raise ValueError(f"squared row norms {tuple(squares.shape)} do not match the rows of {tuple(x.shape)}")
        # the tensor itself, as nan_to_num_ returns it (scaled() tells a copy from the term's own factor)
        return zero_rows_(x, squares.isfinite().logical_not_())
    return torch.nan_to_num(x, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Materialised:
    """The per-sample gradient of one parameter for one use of it.

    Attributes:
        grad: ``[B, *param.shape]`` in the compute dtype (:func:`compute_dtype`).
        rounding: ``[2, B]`` l1 (row 0) and l2 (row 1) rounding scales (:func:`sample_scales`), or ``None``: ``grad_i``
            formed without cancellation, its scales are its own norms.
    """

    grad: torch.Tensor
    rounding: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.grad.device

    @property
    def dtype(self) -> torch.dtype:
        return self.grad.dtype

    def materialise(self) -> torch.Tensor:
        """Return the per-sample gradient ``[B, *param.shape]``."""
        return self.grad

    def rounding_scales(self, norm: int) -> torch.Tensor:
        """``[B]``: each sample's rounding scale in l1 (``norm=1``) or l2, a bound on the norm of ``sum_k |x_ik|`` over
        the products added up to form ``grad_i`` (docs/design.md section 4.10).
        """
        if self.rounding is None:
            return torch.linalg.vector_norm(self.grad.flatten(1), ord=norm, dim=1)
        return self.rounding[0 if norm == 1 else 1]

    def add_to(self, total: torch.Tensor) -> None:
        """``total += grad`` in place; ``total`` ``[B, *param.shape]``."""
        total.add_(self.grad.reshape(total.shape))

    def batch_sum(
        self, weights: torch.Tensor | None = None, writable: Writable | None = None, large_weights: bool = False
    ) -> torch.Tensor:
        """``sum_i w_i grad_i`` (``w_i = 1`` when ``weights`` is None), ``[*param.shape]``; ``weights`` ``[B]``.

        With ``writable`` (the clipped sum: ``w_i = 0`` for every dropped sample), the non-finite entries are zeroed
        first (:func:`finite`), so that a dropped sample adds exactly nothing. ``large_weights`` changes nothing here
        (it concerns factored terms, :meth:`Factored.batch_sum`).
        """
        grad = self.grad if writable is None else finite(self.grad, writable)
        if weights is None:
            return grad.sum(0)
        weights = weights.to(grad.dtype)
        if grad.ndim == 1 or not grad.is_contiguous():
            return torch.tensordot(weights, grad, dims=1)
        # tensordot's own matmul (the same [1, B] x [B, N] mm, the same bits) without its permutes and copies
        return (weights.view(1, -1) @ grad.view(grad.shape[0], -1)).view(grad.shape[1:])

    def add_batch_sum(
        self,
        total: torch.Tensor,
        weights: torch.Tensor | None = None,
        writable: Writable | None = None,
        large_weights: bool = False,
    ) -> None:
        """``total += sum_i w_i grad_i`` in place (:meth:`batch_sum`); ``total`` ``[*param.shape]``."""
        total.add_(self.batch_sum(weights, writable).to(total.dtype))


@dataclass(frozen=True)
class Factored:
    """The per-sample gradient of one parameter for one use, as ``grad_i = reshape(L_i^T R_i, shape)``.

    Attributes:
        left: dense ``[B, T, P]`` (floating point), or token ids ``[B, T]`` standing for one-hot rows (embeddings).
        right: dense ``[B, T, Q]``, the dtype of a dense ``left``.
        shape: the parameter shape, ``shape[0] == P`` and ``prod(shape[1:]) == Q`` for every layer family.
    """

    left: torch.Tensor
    right: torch.Tensor
    shape: torch.Size
    #: The squared row norms ``(||l_it||^2, ||r_it||^2)`` (each ``[B, T]``) once an engine that formed the Gram matrices
    #: has noted their diagonals (:meth:`note_factor_squares`); ``None`` until then.
    _factor_squares: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    #: The rows that count (:attr:`active`), ``[B, T]``, once noted or computed.
    _active: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    #: The factors' row norms by order (:meth:`row_norms`), once computed.
    _row_norms: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def device(self) -> torch.device:
        return self.right.device

    @property
    def dtype(self) -> torch.dtype:
        return self.right.dtype

    def note_factor_squares(self, left: torch.Tensor, right: torch.Tensor, active: torch.Tensor) -> None:
        """Keep the squared row norms ``||l_it||^2`` and ``||r_it||^2`` (``[B, T]`` each, the diagonals of ``L_i L_i^T``
        and ``R_i R_i^T``) for the l2 :meth:`rounding_scales`, which then reads no factor again, and for the underflow
        bound; and the rows that count, ``active`` ``[B, T]`` bool (:attr:`active`), as the engine found them from
        those squares (docs/design.md section 4.10)."""
        object.__setattr__(self, "_factor_squares", (left, right))  # frozen: set once per engine call
        object.__setattr__(self, "_active", active)

    @property
    def noted(self) -> bool:
        """Whether an engine noted the factors' squares (:meth:`note_factor_squares`)."""
        return self._factor_squares is not None

    @property
    def factor_squares(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The squared row norms ``(||l_it||^2, ||r_it||^2)``, ``[B, T]`` each, as noted (:meth:`note_factor_squares`).

        Raises:
            ValueError: no engine noted them.
        """
        if self._factor_squares is None:
            raise ValueError("no engine noted this term's factor squares")
        return self._factor_squares

    def row_norms(self, norm: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The row norms ``(||l_it||, ||r_it||)`` in l1 or l2 (``norm``), ``[B, T]`` each (1 for a one-hot row): in l2
        from the squares :meth:`note_factor_squares` kept where an engine noted them, else computed once per term."""
        if norm == 2 and self.noted:
            left, right = self.factor_squares
            return left.sqrt(), right.sqrt()
        norms = self._row_norms.get(norm)
        if norms is None:
            right = torch.linalg.vector_norm(self.right, norm, dim=-1)
            left = torch.ones_like(right) if self.is_index else torch.linalg.vector_norm(self.left, norm, dim=-1)
            norms = self._row_norms[norm] = (left, right)
        return norms

    @property
    def active(self) -> torch.Tensor:
        """``[B, T]`` bool: the rows that count, all but those 0 in one factor and finite in the other, whose products
        are exact zeros (:func:`~lightning_dp.clipping.rows.active_rows`): as an engine noted them
        (:meth:`note_factor_squares`), else found once from the row norms."""
        if self._active is None:  # norms of either order tell; l1 ones where an l1 run formed them, else l2 ones
            left, right = self._row_norms.get(1) or self.row_norms(2)
            dense = None if self.is_index else self.left
            object.__setattr__(self, "_active", active_rows(dense, self.right, None if dense is None else left, right))
        assert self._active is not None
        return self._active

    def rounding_scales(self, norm: int) -> torch.Tensor:
        """``[B]``: each sample's rounding scale, a bound on the l1 or l2 norm of ``|L_i|^T |R_i|``
        (:meth:`Materialised.rounding_scales`), ``sum_t ||l_t|| ||r_t||`` over the :attr:`active` rows in the norm's
        own order (:meth:`row_norms`): a row that is 0 in one factor and finite in the other (padding) adds nothing.
        """
        left, right = self.row_norms(norm)
        if self.is_index:
            return right.sum(1)
        return torch.where(self.active, left * right, 0.0).sum(1)

    @property
    def is_index(self) -> bool:
        """Whether ``left`` holds token ids rather than a dense matrix."""
        return not self.left.is_floating_point()

    def samples(self, index: slice) -> Factored:
        """The term restricted to the samples ``index``."""
        return Factored(self.left[index], self.right[index], self.shape)

    @property
    def scales_right(self) -> bool:
        """Whether :meth:`batch_sum` scales ``right`` by the weights (ids, or the narrower dense factor)."""
        return self.is_index or self.right.shape[-1] <= self.left.shape[-1]

    def materialise(self) -> torch.Tensor:
        """Return the per-sample gradient ``[B, *shape]`` (memory ``B * P * Q``)."""
        batch, _, cols = self.right.shape
        if self.is_index:
            grad = self.right.new_zeros(batch, self.shape[0], cols)
            grad.scatter_add_(1, self.left.unsqueeze(-1).expand_as(self.right), self.right)
        else:
            grad = torch.bmm(self.left.transpose(1, 2), self.right)
        return grad.reshape(batch, *self.shape)

    def add_to(self, total: torch.Tensor) -> None:
        """``total += L_i^T R_i`` in place without forming the term's ``[B, *shape]``; ``total`` contiguous."""
        batch, _, cols = self.right.shape
        view = total.view(batch, self.shape[0], cols)
        if self.is_index:
            view.scatter_add_(1, self.left.unsqueeze(-1).expand_as(self.right), self.right)
        else:
            view.baddbmm_(self.left.transpose(1, 2), self.right)

    def batch_sum(
        self, weights: torch.Tensor | None = None, writable: Writable | None = None, large_weights: bool = False
    ) -> torch.Tensor:
        """``sum_i w_i L_i^T R_i`` ``[*shape]`` (``w_i = 1`` when ``weights`` ``[B]`` is None), one matmul over the ``B
        T`` rows (book-keeping, Bu et al. 2023, "Differentially private optimization on large model at small cost",
        Section 3).

        With ``writable`` (the clipped sum: ``w_i = 0`` for every dropped sample), the dense factors' non-finite
        entries are zeroed first (:func:`finite`), so that a dropped sample adds exactly nothing. With
        ``large_weights`` (weights that can exceed 1), the rows that do not count (:attr:`active`) are zeroed in the
        factor the weights scale, where scaling could make them overflow and ``0 * inf`` NaN; a weight whose scaling
        would overflow a kept sample's entry in a row that counts is zeroed by the caller
        (:func:`~lightning_dp.clipping.clipped_sum.without_overflow`); should one overflow anyway, it stays infinite
        for the finite check of the sums, since the zeroing runs before the scaling.
        """
        if self.is_index:
            total = self.right.new_zeros(self.shape)
            self.add_batch_sum(total, weights, writable, large_weights)
            return total
        left, right = self._weighted(weights, writable, large_weights)
        return (left.T @ right).reshape(self.shape)

    def add_batch_sum(
        self,
        total: torch.Tensor,
        weights: torch.Tensor | None = None,
        writable: Writable | None = None,
        large_weights: bool = False,
    ) -> None:
        """``total += sum_i w_i L_i^T R_i`` in place (:meth:`batch_sum`) without a buffer of the parameter's size;
        ``total`` ``[*shape]`` contiguous."""
        left, right = self._weighted(weights, writable, large_weights)
        rows = total.view(self.shape[0], right.shape[-1])
        if self.is_index:
            rows.index_add_(0, left, right.to(total.dtype))
        else:
            rows.addmm_(left.T.to(total.dtype), right.to(total.dtype))

    def _weighted(
        self, weights: torch.Tensor | None, writable: Writable | None, large_weights: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The factors of :meth:`batch_sum` as rows over the batch's ``B T`` positions: ``left`` ``[B T, P]`` (ids
        ``[B T]``) and ``right`` ``[B T, Q]``, zeroed where not finite (and, with ``large_weights``, where a row does
        not count in the scaled factor) and weighted."""
        left, right = self.left, self.right
        if writable is not None:  # before the scaling, which thus never turns a kept sample's entry into a zero
            left_squares, right_squares = self._factor_squares or (None, None)
            right = finite(right, writable, right_squares)
            left = left if self.is_index else finite(left, writable, left_squares)
        if weights is not None:  # scale the narrower dense factor (ids cannot be scaled)
            scale = weights.to(right.dtype).view(-1, 1, 1)
            if self.scales_right:
                right = scaled(self._counted(right, self.right, large_weights), scale, self.right)
            else:
                left = scaled(self._counted(left, self.left, large_weights), scale, self.left)
        left = left.reshape(-1) if self.is_index else left.reshape(-1, left.shape[-1])
        return left, right.reshape(-1, right.shape[-1])

    def _counted(self, x: torch.Tensor, original: torch.Tensor, zero_the_rest: bool) -> torch.Tensor:
        """``x`` (``original``, the term's own factor, or a copy of it) as it is, or with ``zero_the_rest`` its rows
        that do not count (:attr:`active`) set to 0: in place in a copy, else in a new one (:func:`scaled` then scales
        that in place)."""
        if not zero_the_rest:
            return x
        return active_only(x, self.active, in_place=x is not original)


Term = Materialised | Factored


def sample_scales(absolute: torch.Tensor) -> torch.Tensor:
    """``[2, B]``: l1 and l2 norms of each sample's row of ``absolute`` ``[B, ...]``."""
    flat = absolute.flatten(1)
    return torch.stack([flat.sum(1), flat.norm(dim=1)])


def product_scales(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``[2, B]``: the rounding scales of ``L_i^T R_i`` (``left`` ``[B, T, P]``, ``right`` ``[B, T, Q]``), ``sum_t
    ||l_t|| ||r_t||`` in l1 (row 0) and l2 (row 1) over the rows that count (:attr:`Factored.active`), the rounding of a
    :class:`Materialised` (:meth:`Factored.rounding_scales`).
    """
    term = Factored(left, right, torch.Size((left.shape[-1], right.shape[-1])))
    return torch.stack([term.rounding_scales(1), term.rounding_scales(2)])


def reduced(values: torch.Tensor, dims: tuple[int, ...]) -> Materialised:
    """The materialised term ``sum_{dims} values`` (``values`` ``[B, ...]``, 0 not in ``dims``) with the rounding scales
    of ``sum_{dims} |values|``.
    """
    if not dims:
        return Materialised(values)
    return Materialised(values.sum(dims), sample_scales(absolute_sum(values, dims)))


def absolute_sum(values: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``sum_{dims} |values|`` (``values`` ``[B, ...]``, the result without ``dims``): on the CPU as a copy ``|values|``
    summed, elsewhere by an l1 ``vector_norm``, which holds no copy (docs/design.md section 12.6)."""
    if values.device.type == "cpu":
        return values.abs().sum(dims)
    return torch.linalg.vector_norm(values, 1, dim=dims)


def term_elements(term: Term) -> int:
    """Number of elements a term holds (both factors of a :class:`Factored`, token ids included)."""
    if isinstance(term, Factored):
        return term.left.numel() + term.right.numel()
    return term.grad.numel()


def batch_sum(
    terms: Sequence[Term],
    weights: torch.Tensor | None = None,
    writable: Writable | None = None,
    large_weights: bool = False,
) -> torch.Tensor:
    """``sum_u sum_i w_i term_ui`` over a parameter's uses ``terms``: ``[*param.shape]`` in their promoted dtype,
    contiguous. The first use's ``batch_sum`` is formed, the others' ``add_batch_sum`` add into it in place (a tied
    embedding and head share one buffer of the parameter's size). ``large_weights``: see
    :meth:`Factored.batch_sum`."""
    dtype = functools.reduce(torch.promote_types, (term.dtype for term in terms))
    total = terms[0].batch_sum(weights, writable, large_weights).to(dtype, memory_format=torch.contiguous_format)
    for term in terms[1:]:
        term.add_batch_sum(total, weights, writable, large_weights)
    return total


def materialise_sum(terms: Sequence[Term]) -> torch.Tensor:
    """Per-sample gradient summed over all uses: ``[B, *param.shape]`` in the promoted dtype. A single term is returned
    uncopied (read-only); several are summed into one new buffer.
    """
    if len(terms) == 1:
        return terms[0].materialise()
    first = next((term for term in terms if isinstance(term, Factored)), terms[0])
    total = first.materialise() if isinstance(first, Factored) else first.grad.clone()
    dtype = functools.reduce(torch.promote_types, (term.dtype for term in terms))
    total = total.to(dtype)
    for term in terms:
        if term is not first:
            term.add_to(total)
    return total


def all_factored(terms: Sequence[Term]) -> TypeGuard[Sequence[Factored]]:
    """Whether every term is :class:`Factored` (the ghost and randomized norms need the factors)."""
    return all(isinstance(term, Factored) for term in terms)


def compute_dtype(param: torch.Tensor) -> torch.dtype:
    """Dtype for per-sample norm arithmetic: float64 for float64 parameters, else float32 (safe under autocast)."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def as_sequence(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reshape ``[B, *lead, d]`` to ``[B, T, d]`` with ``T = prod(lead)`` (``T = 1`` for ``[B, d]``), cast to dtype."""
    return x.reshape(x.shape[0], -1, x.shape[-1]).to(dtype)


def tensor(layer: nn.Module, name: str) -> torch.Tensor:
    """``layer``'s tensor attribute ``name`` (under FSDP2, the unsharded tensor held during the call), typed."""
    return cast(torch.Tensor, getattr(layer, name))


def trainable(layer: nn.Module, name: str) -> bool:
    """Whether ``layer`` has a parameter ``name`` (not None) that requires grad."""
    param = getattr(layer, name, None)
    return param is not None and param.requires_grad
