"""Engine-specific behaviour: the mixed engine's layerwise choice and chunking, fgc's rank-one case, the registry."""

from __future__ import annotations

import pytest
import torch

from lightning_dp.clipping import ENGINES, make_clipping_engine
from lightning_dp.clipping.engines.base import materialised_contribution
from lightning_dp.clipping.engines.ghost import MERGE_ROWS, PANEL_ROWS, gram_squared_norm, self_product
from lightning_dp.clipping.engines.mixed import chunked_squared_norm, ghost_cost, materialise_cost
from lightning_dp.clipping.terms import Factored, Materialised, batch_sum, materialise_sum, product_scales


def _linear_term(batch: int, seq: int, rows: int, cols: int, device: str = "meta") -> Factored:
    left = torch.empty(batch, seq, rows, device=device)
    return Factored(left, torch.empty(batch, seq, cols, device=device), torch.Size((rows, cols)))


def _embedding_term(batch: int, seq: int, rows: int, cols: int) -> Factored:
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return Factored(ids, torch.empty(batch, seq, cols, device="meta"), torch.Size((rows, cols)))


@pytest.mark.parametrize(("seq", "ghost"), [(128, True), (512, False), (2048, False)])
def test_mixed_chooses_by_cost_for_a_tied_gpt2_head(seq: int, ghost: bool) -> None:
    """GPT-2's 50257 x 256 head tied to the token embedding: ghost at T=128, materialised from T=512 on."""
    terms = [_linear_term(8, seq, 50257, 256), _embedding_term(8, seq, 50257, 256)]
    assert (ghost_cost(terms) < materialise_cost(terms)) is ghost


@pytest.mark.parametrize(
    ("term", "ghost"),
    [
        (_embedding_term(8, 128, 50257, 256), True),  # T^2 (1 + Q) = 4.2e6 < P Q = 1.3e7
        (_embedding_term(8, 2048, 50257, 256), False),  # the T^2 Gram outgrows the scatter
        (_linear_term(8, 128, 1024, 1024), True),
        (_linear_term(8, 2048, 256, 256), False),
    ],
)
def test_mixed_rule_for_embeddings_and_projections(term: Factored, ghost: bool) -> None:
    assert (ghost_cost([term]) < materialise_cost([term])) is ghost


def test_chunked_materialisation_is_exact() -> None:
    """Chunks smaller than the batch (2 B T^2 < P Q) give the same norms as materialising the whole batch."""
    gen = torch.Generator().manual_seed(0)
    dense = Factored(
        torch.randn(5, 3, 40, generator=gen, dtype=torch.float64),
        torch.randn(5, 3, 30, generator=gen, dtype=torch.float64),
        torch.Size((40, 30)),
    )
    ids = Factored(
        torch.randint(0, 40, (5, 2), generator=gen),
        torch.randn(5, 2, 30, generator=gen, dtype=torch.float64),
        dense.shape,
    )
    assert 2 * 5 * 3 * 3 < 40 * 30  # chunks of one sample
    torch.testing.assert_close(chunked_squared_norm([dense, ids]), materialised_contribution([dense, ids], 2))


def test_fgc_rank_one_case_matches_materialised() -> None:
    gen = torch.Generator().manual_seed(1)
    term = Factored(
        torch.randn(4, 1, 6, generator=gen, dtype=torch.float64),
        torch.randn(4, 1, 5, generator=gen, dtype=torch.float64),
        torch.Size((6, 5)),
    )
    torch.testing.assert_close(
        make_clipping_engine("fgc").contribution([term], 2), materialised_contribution([term], 2)
    )


def test_registry_lists_every_engine() -> None:
    assert set(ENGINES) == {"flat", "ghost", "fgc", "mixed", "hutch", "hutchpp"}
    assert [name for name, cls in ENGINES.items() if cls.randomized] == ["hutch", "hutchpp"]
    with pytest.raises(ValueError, match="Unknown clipping"):
        make_clipping_engine("nope")


def test_materialise_sum_writes_no_term_and_promotes_dtype() -> None:
    """The sum of several uses goes into a new buffer: neither a materialised term (which may be a capture's own
    output gradient, as a LayerNorm bias's is) nor a factor is written; mixed dtypes promote as ``+`` would."""
    gen = torch.Generator().manual_seed(2)
    shared = torch.randn(3, 1, 4, generator=gen)  # per-sample gradients of a 1 x 4 parameter
    first, second = Materialised(shared), Materialised(shared[:, :, :])
    dense = Factored(torch.randn(3, 2, 1, generator=gen), torch.randn(3, 2, 4, generator=gen), torch.Size((1, 4)))
    before = [shared.clone(), dense.left.clone(), dense.right.clone()]
    total = materialise_sum([first, second, dense])
    torch.testing.assert_close(total, 2 * shared + dense.materialise())
    for tensor, copy in zip([shared, dense.left, dense.right], before, strict=True):
        assert torch.equal(tensor, copy)
    assert materialise_sum([first]) is shared  # one use: no copy
    wide = Materialised(torch.randn(3, 1, 4, generator=gen, dtype=torch.float64))
    assert materialise_sum([Materialised(shared.to(torch.bfloat16)), wide]).dtype == torch.float64


def test_batch_sum_of_several_uses_adds_into_the_first_and_writes_no_term() -> None:
    """A tied parameter's weighted sum over its uses (an embedding's ids, a dense head, a materialised use) is the sum
    of each use's own, formed in the first use's buffer; no factor or term is written, and dtypes promote as ``+``."""
    gen = torch.Generator().manual_seed(3)
    ids = Factored(torch.tensor([[0, 2], [1, 1], [2, 0]]), torch.randn(3, 2, 4, generator=gen), torch.Size((3, 4)))
    dense = Factored(torch.randn(3, 5, 3, generator=gen), torch.randn(3, 5, 4, generator=gen), torch.Size((3, 4)))
    full = Materialised(torch.randn(3, 3, 4, generator=gen))
    weights = torch.tensor([0.5, 0.0, 2.0])
    factors = [ids.right, dense.left, dense.right, full.grad]
    before = [factor.clone() for factor in factors]
    for uses in ([ids, dense, full], [dense, ids, full], [full, dense, ids]):
        expected = sum(use.batch_sum(weights) for use in uses)
        torch.testing.assert_close(batch_sum(uses, weights), expected)
        torch.testing.assert_close(batch_sum(uses), sum(use.batch_sum() for use in uses))
    for factor, copy in zip(factors, before, strict=True):
        assert torch.equal(factor, copy)
    wide = Materialised(full.grad.double())
    assert batch_sum([ids, wide]).dtype == torch.float64


@pytest.mark.parametrize("rows", [PANEL_ROWS - 1, PANEL_ROWS, PANEL_ROWS + 1, 2 * PANEL_ROWS + 3])
def test_self_product_from_panels_equals_the_full_gram_product(rows: int) -> None:
    """A long use's ``<L L^T, R R^T>`` from two panels per Gram matrix is the full product's (float64), and the
    squared norm of the materialised per-sample gradient."""
    gen = torch.Generator().manual_seed(4)
    term = Factored(
        torch.randn(3, rows, 7, generator=gen, dtype=torch.float64),
        torch.randn(3, rows, 5, generator=gen, dtype=torch.float64),
        torch.Size((7, 5)),
    )
    full = (term.left @ term.left.transpose(1, 2) * (term.right @ term.right.transpose(1, 2))).sum((1, 2))
    product, diagonals, active = self_product(term)
    assert bool(active.all())
    torch.testing.assert_close(product, full, rtol=1e-12, atol=0)
    torch.testing.assert_close(product, term.materialise().pow(2).sum((1, 2)), rtol=1e-12, atol=0)
    squares = torch.stack([term.left.square().sum(2), term.right.square().sum(2)])
    torch.testing.assert_close(diagonals, squares, rtol=1e-12, atol=0)


def _dense_use(gen: torch.Generator, rows: int, dtype: torch.dtype) -> Factored:
    left = torch.randn(3, rows, 9, generator=gen, dtype=dtype)
    return Factored(left, torch.randn(3, rows, 6, generator=gen, dtype=dtype), torch.Size((9, 6)))


def _ids_use(gen: torch.Generator, rows: int, dtype: torch.dtype) -> Factored:
    ids = torch.randint(0, 9, (3, rows), generator=gen)
    return Factored(ids, torch.randn(3, rows, 6, generator=gen, dtype=dtype), torch.Size((9, 6)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "uses",
    [
        [("dense", PANEL_ROWS + 3)],  # two panels
        [("dense", 5)],
        [("ids", 7)],
        [("dense", 4), ("dense", 6), ("ids", 3), ("ids", 5), ("dense", PANEL_ROWS)],  # merged groups of each kind
        [("dense", MERGE_ROWS - 2), ("dense", 3)],  # the second use starts a group of its own
    ],
)
def test_ghost_rounding_scales_come_from_the_gram_diagonals(uses: list[tuple[str, int]], dtype: torch.dtype) -> None:
    """After the ghost norm, each use's l2 rounding scale ``sum_t ||l_t|| ||r_t||`` is read from the Gram diagonals of
    its own rows (merged uses split back), equal to the factors' row norms (a one-hot row has norm 1); l1 is
    unchanged."""
    gen = torch.Generator().manual_seed(6)
    terms = [(_dense_use if kind == "dense" else _ids_use)(gen, rows, dtype) for kind, rows in uses]
    fresh = [Factored(t.left, t.right, t.shape) for t in terms]
    expected = [
        t.right.norm(dim=2).sum(1) if t.is_index else (t.left.norm(dim=2) * t.right.norm(dim=2)).sum(1) for t in terms
    ]
    before = [t.rounding_scales(1) for t in fresh]
    gram_squared_norm(terms)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    for term, fresh_term, scale, l1 in zip(terms, fresh, expected, before, strict=True):
        torch.testing.assert_close(term.rounding_scales(2), scale, rtol=rtol, atol=0)
        torch.testing.assert_close(fresh_term.rounding_scales(2), scale, rtol=rtol, atol=0)  # not noted: by norms
        torch.testing.assert_close(term.rounding_scales(1), l1, rtol=0, atol=0)
        if not term.is_index:
            torch.testing.assert_close(product_scales(term.left, term.right)[1], scale, rtol=rtol, atol=0)
