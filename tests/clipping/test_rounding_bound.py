"""The clip factor's rounding bound (docs/design.md section 4.10): each term's per-sample rounding scales bound the
norms of the summed absolute products that form its gradient, ``rounded_norm_bound`` turns them into an upper bound
on the norm of what the clipped sum adds, and an example made of large cancelling parts then moves the release by at
most ``C`` with every exact engine (the broad grid is ``tests/clipping/test_fuzz_crafted.py``)."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from clipping_helpers import flush_to_zero
from torch import nn

from lightning_dp.clipping import PerSampleClipper
from lightning_dp.clipping.rounding import HALF_PRECISION_WARNING, rounded_norm_bound
from lightning_dp.clipping.terms import Factored, Materialised, reduced

B, T, P, Q = 3, 5, 4, 6


def _absolute_products(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``|L_i|^T |R_i|`` per sample, ``[B, P, Q]``."""
    return torch.bmm(left.abs().transpose(1, 2), right.abs())


@pytest.mark.parametrize("norm", [1, 2])
def test_factored_scales_bound_the_absolute_products(norm: int) -> None:
    gen = torch.Generator().manual_seed(0)
    left, right = torch.randn(B, T, P, generator=gen), torch.randn(B, T, Q, generator=gen)
    exact = torch.linalg.vector_norm(_absolute_products(left, right).flatten(1), ord=norm, dim=1)
    scales = Factored(left, right, torch.Size([P, Q])).rounding_scales(norm)
    assert (scales >= exact * (1 - 1e-6)).all()
    if norm == 1:  # exact in l1
        torch.testing.assert_close(scales, exact)


@pytest.mark.parametrize("norm", [1, 2])
def test_token_id_scales_bound_the_scatter_of_absolute_rows(norm: int) -> None:
    ids = torch.tensor([[0, 2, 0, 0, 1], [3, 3, 3, 3, 3], [1, 2, 3, 0, 1]])
    right = torch.randn(B, T, Q, generator=torch.Generator().manual_seed(1))
    one_hot = nn.functional.one_hot(ids, P).float()
    exact = torch.linalg.vector_norm(_absolute_products(one_hot, right).flatten(1), ord=norm, dim=1)
    scales = Factored(ids, right, torch.Size([P, Q])).rounding_scales(norm)
    assert (scales >= exact * (1 - 1e-6)).all()


def test_reduced_terms_carry_the_scales_of_what_they_add_up() -> None:
    values = torch.randn(B, T, Q, generator=torch.Generator().manual_seed(2))
    values[:, 1] = -values[:, 0]  # two positions that cancel
    term = reduced(values, (1,))
    torch.testing.assert_close(term.grad, values.sum(1))
    for norm in (1, 2):
        expected = torch.linalg.vector_norm(values.abs().sum(1), ord=norm, dim=1)
        torch.testing.assert_close(term.rounding_scales(norm), expected)
        assert (term.rounding_scales(norm) > torch.linalg.vector_norm(term.grad, ord=norm, dim=1)).all()
    plain = Materialised(values.sum(1))
    torch.testing.assert_close(plain.rounding_scales(2), plain.grad.norm(dim=1))


def test_rounded_norm_bound_formula_and_non_finite_scales() -> None:
    eps = torch.finfo(torch.float32).eps
    r = 128 * eps
    totals = torch.tensor([[4.0, 0.0, 1.0, 1.0]])
    scales = torch.tensor([[9.0, 1e6, math.inf, math.nan]])
    l2 = rounded_norm_bound(totals, scales, 2, eps)
    torch.testing.assert_close(l2[0, :2], torch.tensor([math.sqrt(4 + 9 * r) + 3 * r, math.sqrt(1e6 * r) + 1e3 * r]))
    assert math.isinf(l2[0, 2]) and math.isinf(l2[0, 3])  # a NaN bound becomes inf: factor 0, never NaN
    l1 = rounded_norm_bound(totals, scales, 1, eps)
    torch.testing.assert_close(l1[0, :2], torch.tensor([4 + 18 * r, 2e6 * r]))


#: the standard factor, and automatic clipping at gamma = 0 (docs/design.md section 4.11), whose factors are largest
CLIP_FUNCTIONS = {"abadi": {}, "automatic": {"clipping_fn": "automatic", "automatic_clipping_gamma": 0.0}}


@pytest.mark.parametrize("clip_function", sorted(CLIP_FUNCTIONS))
@pytest.mark.parametrize("clipping", ["flat", "ghost", "fgc", "mixed"])
@pytest.mark.parametrize("magnitude", [1e4, 1e8])
def test_cancelling_tokens_move_the_float32_release_by_at_most_c(
    magnitude: float, clipping: str, clip_function: str
) -> None:
    """Two tokens ``m (u + rho e_1)`` and ``m (u + rho e_2)`` with output gradients ``v`` and ``-v`` (``rho = 1e2 /
    m``): the true gradient is ``O(100)``, each token's ``O(m)``. Ghost norms subtract squares of order ``m^2`` and
    reported a norm near 0 for it, and every engine's sum rounds it otherwise than its norm; the release moved by up
    to 1e7 ``C``. With the rounding bound it moves by at most ``C``, with either clip function."""
    gen = torch.Generator().manual_seed(3)
    layer = nn.Linear(P, Q, bias=False)
    ordinary = torch.randn(4, 2, P, generator=gen)
    u, rho = torch.randn(P, generator=gen), 1e2 / magnitude
    crafted = magnitude * torch.stack([u + rho * torch.eye(P)[0], u + rho * torch.eye(P)[1]])
    direction = torch.randn(Q, generator=gen)
    token_weights = torch.ones(5, 2)
    token_weights[4, 1] = -1.0  # the crafted example's tokens get output gradients v and -v
    sums = []
    for x in (ordinary, torch.cat([ordinary, crafted[None]])):
        model = copy.deepcopy(layer)
        clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=1.0, **CLIP_FUNCTIONS[clip_function])
        loss = ((model(x) * direction).sum(-1) * token_weights[: x.shape[0]]).sum(1)  # linear in the output
        clipper.backward(loss)
        sums.append(model.weight.grad.double())
    assert float((sums[1] - sums[0]).norm()) <= 1.0 + 1e-4


def _alternating_tokens(magnitude: float, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Four ordinary sequences and one crafted (last): ``T = 8`` tokens ``m (u + q e_t)`` with output weights of
    alternating sign ``(-1)^t (v + q f_t)``, ``q = 100 / m``: each token's gradient is ``O(m)``, their sum ``O(100)``
    (inputs ``[T, 16]``, weights ``[T, 3]``, float64 values)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    inputs, weights = [draw(8, 16) for _ in range(4)], [draw(8, 3) for _ in range(4)]
    q, signs = 100 / magnitude, torch.tensor([(-1.0) ** t for t in range(8)], dtype=torch.float64)
    weights.append(signs[:, None] * (draw(3) + q * draw(8, 3)))
    inputs.append(magnitude * (draw(16).expand(8, 16) + q * draw(8, 16)))
    return inputs, weights


def test_autocast_around_the_backward_does_not_lower_the_precision_of_the_norms() -> None:
    """The clipper's own arithmetic (terms, norms, book-keeping's sums) runs with autocast off and float32 matmuls
    at full precision, so the rounding bound's float32 epsilons hold when the caller runs the backward under bf16
    autocast: ghost norms of alternating tokens of magnitude 1e4 moved the release by 2 ``C`` before."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 3))

    def release(inputs: list[torch.Tensor], weights: list[torch.Tensor], bound: float) -> torch.Tensor:
        model = copy.deepcopy(base)
        clipper = PerSampleClipper(model, clipping="ghost", max_grad_norm=bound, sum_check_every=None)
        x, w = torch.stack(inputs).float(), torch.stack(weights).float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            clipper.backward((w * model(x).float()).flatten(1).sum(1))
        assert torch.get_float32_matmul_precision() == "highest"
        return torch.cat([p.grad.flatten().double() for p in model.parameters()])

    for seed in range(5):
        inputs, weights = _alternating_tokens(1e4, seed)
        bound = 1.0
        moved = release(inputs, weights, bound) - release(inputs[:4], weights[:4], bound)
        assert float(moved.norm()) <= bound * (1 + 1e-4), seed


def _cancelling_pair(magnitude: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows ``m (u + q a)``, ``m (u + q b)`` with output weights ``v + q c`` and ``-(v + q d)``, ``q = 100 / m``
    (inputs ``[2, 16]``, weights ``[2, 3]``, float64): each row's gradient is ``O(m)``, their sum ``O(100)``."""

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, u, v = 100 / magnitude, draw(16), draw(3)
    x = magnitude * torch.stack([u + q * draw(16), u + q * draw(16)])
    return x, torch.stack([v + q * draw(3), -(v + q * draw(3))])


def _release(base: nn.Module, x: torch.Tensor, w: torch.Tensor, engine: str, options: dict, past=None) -> torch.Tensor:
    """The clipped sum (C = 1) of the loss ``sum (w * model(x))`` per example, flattened over the parameters."""
    copies = options.get("augmentation_multiplicity", 1)
    model = copy.deepcopy(base)
    clipper = PerSampleClipper(model, clipping=engine, max_grad_norm=1.0, **options)
    if past is not None:
        past_x, past_w, past_weight = past
        clipper.add_past_iterate((past_w.float() * model(past_x.float())).flatten(1).sum(1), past_weight)
    clipper.backward((w.float() * model(x.float())).flatten(1).sum(1).reshape(-1, copies).sum(1))
    return torch.cat([p.grad.flatten().double() for p in model.parameters()])


@pytest.mark.parametrize("clip_function", sorted(CLIP_FUNCTIONS))
@pytest.mark.parametrize(
    ("setting", "engine"),
    [(s, e) for s in ("multiplicity", "groups", "past_iterate") for e in ("flat", "ghost", "fgc", "mixed")]
    + [("l1", "flat")],
)
def test_cancelling_parts_across_copies_groups_iterates_and_in_l1_stay_within_c(
    setting: str, engine: str, clip_function: str
) -> None:
    """The rounding scales add up over augmented copies, clipping groups and past iterates, and have an l1 form: the
    crafted example's cancelling parts are its two augmented copies, two tokens under per-layer groups, its current
    and past iterate, or two tokens under l1 clipping (flat only); float32, magnitudes 1e4 and 1e8; either clip
    function."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 3))
    for magnitude in (1e4, 1e8):
        for seed in range(3):
            gen = torch.Generator().manual_seed(seed)
            x, w = _cancelling_pair(magnitude, gen)
            if setting == "multiplicity":  # 3 ordinary examples of 2 copies each, one row per copy
                xs = torch.randn(6, 1, 16, generator=gen, dtype=torch.float64)
                ws = torch.randn(6, 1, 3, generator=gen, dtype=torch.float64)
                options = {"augmentation_multiplicity": 2, **CLIP_FUNCTIONS[clip_function]}
                without = _release(base, xs, ws, engine, options)
                with_ = _release(base, torch.cat([xs, x[:, None]]), torch.cat([ws, w[:, None]]), engine, options)
            elif setting == "past_iterate":  # the current row is x[0], the past iterate's x[1]
                xs = torch.randn(3, 2, 16, generator=gen, dtype=torch.float64)
                ws = torch.randn(3, 2, 3, generator=gen, dtype=torch.float64)
                options = CLIP_FUNCTIONS[clip_function]
                without = _release(base, xs[:, :1], ws[:, :1], engine, options, past=(xs[:, 1:], ws[:, 1:], 0.7))
                current = (torch.cat([xs[:, :1], x[None, :1]]), torch.cat([ws[:, :1], w[None, :1]]))
                past = (torch.cat([xs[:, 1:], x[None, 1:]]), torch.cat([ws[:, 1:], w[None, 1:]]), 0.7)
                with_ = _release(base, *current, engine, options, past=past)
            else:  # two cancelling tokens of one example
                xs = torch.randn(3, 2, 16, generator=gen, dtype=torch.float64)
                ws = torch.randn(3, 2, 3, generator=gen, dtype=torch.float64)
                options = {"clipping_groups": "per_layer"} if setting == "groups" else {"norm": 1}
                options = {**options, **CLIP_FUNCTIONS[clip_function]}
                without = _release(base, xs, ws, engine, options)
                with_ = _release(base, torch.cat([xs, x[None]]), torch.cat([ws, w[None]]), engine, options)
            moved = float(torch.linalg.vector_norm(with_ - without, ord=1 if setting == "l1" else 2))
            assert moved <= 1.0 + 1e-4, (magnitude, seed, moved)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_unsharded_half_precision_parameters_are_not_warned_about(dtype, caplog: pytest.LogCaptureFixture) -> None:
    """Unsharded 16-bit parameters keep their clipped sum in float32 and are cast after the noise (post-processing,
    tests/clipping/test_float32_sums.py): no warning. The warning is for FSDP2-sharded ones, which still round the sum
    into their .grad."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1).to(dtype))
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        PerSampleClipper(model, max_grad_norm=1.0)
    assert not [r for r in caplog.records if "rounded to that dtype" in r.getMessage()]
    assert "FSDP2-sharded" in HALF_PRECISION_WARNING


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("clipping", "seq"), [("ghost", 64), ("ghost", 130), ("fgc", 1), ("mixed", 4)])
def test_activations_whose_squares_underflow_move_the_release_by_at_most_c(
    clipping: str, seq: int, dtype: torch.dtype
) -> None:
    """An example whose activations are so small that their squares underflow (float32: 2.5e-23) and whose output
    gradients are as large as the squares allow: its Gram matrix ``L L^T`` is 0, so its ghost norm and rounding scale
    were 0 and it was added unclipped (27 ``C`` in float32 at ``T = 64``), while its gradient ``L^T R`` is well
    within range. The underflow bound of the Gram-product norms (``underflow.underflow_bound``) keeps it within ``C``;
    ``T = 130`` runs the Gram panels; ``mixed`` takes the ghost norm at ``T = 4`` (a 4 x 64 weight)."""
    tiny, huge = (2.5e-23, 1.7e19) if dtype == torch.float32 else (1e-162, 1.3e154)
    layer = nn.Linear(64, 4, bias=False).to(dtype)
    x = torch.randn(2, seq, 64, generator=torch.Generator().manual_seed(7), dtype=dtype)
    x[0] = 0.0  # the first example contributes nothing: the sum is the crafted example's contribution
    x[1] = tiny
    weights = torch.ones(2, seq, 4, dtype=dtype) * huge / (seq * 4) ** 0.5
    true_norm = float(torch.linalg.vector_norm(x[1].double().T @ weights[1].double()))
    bound = true_norm / 20  # so that an unclipped example would move the release by 20 C
    clipper = PerSampleClipper(layer, clipping=clipping, max_grad_norm=bound, sum_check_every=None)
    clipper.backward((layer(x) * weights).sum((1, 2)))
    assert float(layer.weight.grad.double().norm()) <= bound * (1 + 1e-4)


@pytest.mark.parametrize("ftz", [False, True])
@pytest.mark.parametrize("clipping", ["flat", "ghost"])
def test_squares_that_underflow_under_automatic_clipping_at_gamma_0_move_the_release_by_at_most_c(
    clipping: str, ftz: bool
) -> None:
    """Normalised SGD (``C / nu``, no ``1e-6`` as in ``min(1, C / (nu + 1e-6))``) divides by whatever the norm kept:
    an example with one entry whose square survives and 99,999 whose squares underflow moved the release by 211
    ``C`` (263 with flush-to-zero); an example whose bias gradient's squares flush to zero moved it by 14.5 ``C``
    once another parameter's underflow bound made its ``nu`` positive; a loss scale's unscaling pushed ``r S^2``
    below the smallest normal number, which flush-to-zero dropped (37.8 ``C``). Every parameter's underflow bound
    (``underflow.underflow_bound``), formed before the unscaling, keeps each within ``C``."""
    automatic = {"clipping_fn": "automatic", "automatic_clipping_gamma": 0.0, "sum_check_every": None}
    with flush_to_zero(ftz):
        small, big = (1e-19, 1.2e-19) if ftz else (2.5e-23, 4e-23)
        wide = nn.Linear(100_000, 1, bias=False)
        x = torch.zeros(2, 100_000)
        x[1] = small
        x[1, 0] = big
        PerSampleClipper(wide, clipping=clipping, max_grad_norm=1.0, **automatic).backward(wide(x).sum(1))
        assert float(wide.weight.grad.double().norm()) <= 1.0 + 1e-4

        biased = nn.Linear(8, 1000)
        weights = torch.zeros(2, 1000)
        weights[1] = 1e-19  # output gradients whose squares flush to zero; input 0: only the bias has a gradient
        PerSampleClipper(biased, clipping=clipping, max_grad_norm=1.0, **automatic).backward(
            (biased(torch.zeros(2, 8)) * weights).sum(1)
        )
        assert float(biased.bias.grad.double().norm()) <= 1.0 + 1e-4

        single = nn.Linear(1, 1, bias=False)
        clipper = PerSampleClipper(single, clipping=clipping, max_grad_norm=1.0, **automatic)
        clipper.loss_scale = 256.0
        x, weights = torch.zeros(2, 1, 1), torch.zeros(2, 1, 1)
        x[1], weights[1] = 3.2e-10, 1e-10 / 256
        clipper.backward((single(x) * weights).sum((1, 2)))
        assert float(single.weight.grad.double().norm()) <= 1.0 + 1e-4


@pytest.mark.parametrize("clipping", ["ghost", "flat", "mixed"])
def test_an_examples_clipped_gradient_does_not_depend_on_how_far_its_batch_is_padded(clipping: str) -> None:
    """Padding to the longest sampled sequence adds rows whose output gradients are 0 (the loss ignores them) but whose
    activations are not. The rounding scale ``||L_i||_F ||R_i||_F`` counted them, so another example's presence moved
    this one's clip factor (0.24 % of ``C`` from 8 to 512 rows, found in review); ``sum_t ||l_t|| ||r_t||`` does not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 50))
    tokens = torch.randint(1, 50, (6,))

    def clipped(rows: int) -> torch.Tensor:
        ids = torch.zeros(1, rows, dtype=torch.long)
        ids[0, :6] = tokens
        labels = ids.clone()
        labels[0, 6:] = -100
        model.zero_grad(set_to_none=True)
        clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=0.1, sum_check_every=None)
        try:
            logits = model(ids)
            clipper.backward(nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(1))
        finally:
            clipper.detach()
        return torch.cat([p.grad.flatten() for p in model.parameters()]).double()

    short, long = clipped(8), clipped(512)
    assert float(short.norm()) == pytest.approx(0.1, rel=1e-3)  # clipped
    assert float((short - long).norm()) <= 1e-6 * float(short.norm())


@pytest.mark.parametrize("output_grad", [1e-18, 1.0])
@pytest.mark.parametrize("clipping", ["ghost", "mixed", "flat", "fgc"])
def test_an_example_whose_rounding_scale_overflows_is_dropped_whatever_its_batchs_padding(
    clipping: str, output_grad: float
) -> None:
    """A row of activations 1e20 (its square overflows float32) makes the example's rounding scale, and so ``nu_i``,
    infinite: factor 0 on every path. The norm computed beside it was what the overflow left, which the padded length
    moved (``mixed`` materialised a finite 2.1e3 from 100 rows and formed inf below; the panels' ghost norm gave -inf,
    NaN or 0 between 100 and 255 rows, found in review), and so did ``dropped_nonfinite`` and adaptive clipping's
    count (``clamp_min(0)`` read -inf as 0, unclipped). Now its norm is inf at every length: dropped and counted
    clipped, and the release is the other example's alone."""
    layer = nn.Linear(16, 16)

    def clip(rows: int, with_example: bool) -> tuple[torch.Tensor, bool, torch.Tensor]:
        gen = torch.Generator().manual_seed(rows)
        x, w = torch.zeros(2, rows, 16), torch.zeros(2, rows, 16)
        x[0, :6], w[0, :6] = torch.randn(6, 16, generator=gen), torch.randn(6, 16, generator=gen) * output_grad
        x[0, 2] = torch.randn(16, generator=gen) * 1e20  # finite, and the layer's output too
        x[1], w[1] = torch.randn(rows, 16, generator=gen), torch.randn(rows, 16, generator=gen)
        if not with_example:
            w[0] = 0
        layer.zero_grad(set_to_none=True)
        clipper = PerSampleClipper(layer, clipping=clipping, max_grad_norm=1.0, sum_check_every=None)
        try:
            norms = clipper.backward((layer(x) * w).sum((1, 2)))
            return norms, clipper.dropped_nonfinite, torch.cat([p.grad.flatten() for p in layer.parameters()])
        finally:
            clipper.detach()

    for rows in (8, 100, 127, 128, 200, 255, 256):
        norms, dropped, release = clip(rows, with_example=True)
        assert math.isinf(norms[0]) and norms[0] > 0 and dropped, rows
        assert math.isfinite(norms[1])
        _, dropped_alone, alone = clip(rows, with_example=False)
        assert not dropped_alone
        torch.testing.assert_close(release, alone, rtol=0, atol=0)
