"""Augmentation multiplicity in the clipper (De et al. 2022, Section 3.2): B examples x K augmented copies, the
example's gradient the AVERAGE of its copies' gradients, clipped once. Every exact engine against a torch.func oracle
(per-row gradients, averaged per example, clipped, summed) on a conv + GroupNorm + linear model, an embedding + conv1d +
LayerNorm model with a tied head and an embedding + sequence-first nn.MultiheadAttention model; one example blown up
still moves the clipped sum by at most C; identical copies give exactly the K = 1 numbers (randomized engines included);
K = 1 is the clipper of before; clipping groups, per-sample momentum and non-finite copies; wrong row counts, row order
and values refused."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from clipping_helpers import PER_LAYER, TiedModel, expected_sum, group_norms, randomise
from torch import nn
from torch.func import functional_call, grad, vmap

from lightning_dp import augment_each_example, augmentation_mean, repeat_for_multiplicity
from lightning_dp.checks.independence import BatchMixingError, check_batch_independence
from lightning_dp.clipping import PerSampleClipper
from lightning_dp.clipping.multiplicity import fold_copies
from lightning_dp.clipping.terms import Factored, Materialised
from lightning_dp.optim.momentum import PerSampleMomentum, momentum_weights

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")

EXACT = ("flat", "ghost", "fgc", "mixed")
B, K = 5, 3
VOCAB, SEQ = 7, 4


class ConvNet(nn.Module):
    """Conv2d -> GroupNorm -> tanh -> Linear on ``[N, 2, 4, 4]`` images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.norm = nn.GroupNorm(1, 3)
        self.head = nn.Linear(3 * 16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.conv(x)).tanh().flatten(1))


class AttentionNet(nn.Module):
    """Embedding -> sequence-first nn.MultiheadAttention (swapped by the clipper) -> Linear, on ids ``[N, T]``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4)
        self.attn = nn.MultiheadAttention(4, 2)
        self.head = nn.Linear(4, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).transpose(0, 1)
        return self.head(self.attn(h, h, h, need_weights=False)[0].transpose(0, 1))


def _image_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1)


def _image_rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``B K`` augmented rows, sample-major: each example's image plus per-copy noise, its label repeated."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 2, 4, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 4, (B,), generator=generator)
    rows, labels = repeat_for_multiplicity((x, y), K)
    return rows + 0.3 * torch.randn(rows.shape, generator=generator, dtype=rows.dtype), labels


def _token_rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``B K`` copies of each example's ids with one token per copy replaced at random ("augmented")."""
    generator = torch.Generator().manual_seed(seed)
    ids, targets = repeat_for_multiplicity(tuple(torch.randint(0, VOCAB, (2, B, SEQ), generator=generator)), K)
    ids = ids.clone()
    ids[torch.arange(B * K), torch.randint(0, SEQ, (B * K,), generator=generator)] = torch.randint(
        0, VOCAB, (B * K,), generator=generator
    )
    return ids, targets


#: name -> (model factory, batch factory, per-row loss of the model output).
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], tuple[torch.Tensor, torch.Tensor]], Callable]] = {
    "conv": (ConvNet, _image_rows, _image_loss),
    "tied_embedding": (TiedModel, _token_rows, _token_loss),
    "attention": (AttentionNet, _token_rows, _token_loss),
}


def _setup(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable]:
    make, rows, loss = MODELS[name]
    torch.manual_seed(seed)
    return randomise(make(), seed), *rows(seed), loss


def _example_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Callable) -> torch.Tensor:
    """``[B]``: each example's mean over its copies' losses."""
    return augmentation_mean(loss(model(x), y), K)


def _oracle(model: nn.Module, params: dict[str, torch.Tensor], x, y, loss) -> dict[str, torch.Tensor]:
    """Per-EXAMPLE gradients ``{name: [B, *shape]}``: per-row gradients (torch.func) averaged over each example's
    ``K`` rows (sample-major)."""

    def one(p, xi, yi):
        return loss(functional_call(model, p, (xi[None],)), yi[None])[0]

    rows = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    return {n: g.reshape(B, K, *g.shape[1:]).mean(1) for n, g in rows.items()}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def _clipped(grads: dict[str, torch.Tensor], bound: float) -> dict[str, torch.Tensor]:
    return expected_sum(grads, dict.fromkeys(grads, 0), [bound])


def _norms(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return group_norms(grads, dict.fromkeys(grads, 0))[0]


@pytest.mark.parametrize("engine", EXACT)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_clipped_sum_of_averaged_copies_matches_oracle(name: str, engine: str) -> None:
    model, x, y, loss = _setup(name)
    grads = _oracle(model, _params(model), x, y, loss)
    norms = _norms(grads)
    bound = float(norms.median())  # about half the examples clipped
    clipper = PerSampleClipper(
        model, clipping=engine, max_grad_norm=bound, sum_check_every=1, augmentation_multiplicity=K
    )
    returned = clipper.backward(_example_losses(model, x, y, loss))
    torch.testing.assert_close(returned, norms, rtol=1e-9, atol=1e-12)
    assert 0 < int((returned > bound).sum()) < B
    expected = _clipped(grads, bound)
    for param_name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[param_name], rtol=1e-9, atol=1e-12, msg=param_name)
    clipper.detach()


@pytest.mark.parametrize("engine", EXACT)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_example_blown_up_moves_the_clipped_sum_by_at_most_c(name: str, engine: str) -> None:
    """The sensitivity under add/remove adjacency: example 2's copies' losses scaled up hugely give one clipped vector
    of norm <= C, never K C."""
    model, x, y, loss = _setup(name)
    bound = 0.5
    blow_up = torch.ones(B * K, dtype=torch.float64)
    blow_up[2 * K : 3 * K] = 1e4
    sums = []
    for keep in (torch.arange(B), torch.tensor([0, 1, 3, 4])):
        model.zero_grad(set_to_none=True)
        rows = (keep[:, None] * K + torch.arange(K)).flatten()
        clipper = PerSampleClipper(model, clipping=engine, max_grad_norm=bound, augmentation_multiplicity=K)
        norms = clipper.backward(augmentation_mean(loss(model(x[rows]), y[rows]) * blow_up[rows], K))
        if len(keep) == B:
            assert norms[2] > 1e3 * bound
        clipper.detach()
        sums.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    moved = float((sums[0] - sums[1]).norm())
    assert bound * 0.99 < moved <= bound * (1 + 1e-9)


@pytest.mark.parametrize("engine", [*EXACT, "hutch", "hutchpp"])
def test_identical_copies_give_the_numbers_of_one_copy(engine: str) -> None:
    """K copies of each example without augmentation: the average of K equal gradients is the gradient, so norms and
    clipped sums equal those of K = 1 on the examples (the randomized engines from the same projection stream)."""
    results = []
    for copies in (1, K):
        model, x, y, loss = _setup("tied_embedding")
        x, y = x[::K], y[::K]  # one row per example
        projections = torch.Generator().manual_seed(7)
        clipper = PerSampleClipper(
            model,
            clipping=engine,
            max_grad_norm=0.05,
            generator_for=lambda device, projections=projections: projections,
            augmentation_multiplicity=copies,
        )
        rows_x, rows_y = repeat_for_multiplicity((x, y), copies)
        norms = clipper.backward(augmentation_mean(loss(model(rows_x), rows_y), copies))
        results.append([norms, *(p.grad for p in model.parameters())])
        clipper.detach()
    for one, many in zip(*results, strict=True):
        torch.testing.assert_close(many, one, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("engine", EXACT)
def test_multiplicity_one_is_the_clipper_of_before_bit_for_bit(engine: str) -> None:
    results = []
    for options in ({}, {"augmentation_multiplicity": 1}):
        model, x, y, loss = _setup("conv")
        clipper = PerSampleClipper(model, clipping=engine, max_grad_norm=0.05, **options)
        norms = clipper.backward(loss(model(x), y))
        results.append([norms, *(p.grad for p in model.parameters())])
        clipper.detach()
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("engine", EXACT)
def test_clipping_groups_clip_each_group_of_the_averaged_gradient(engine: str) -> None:
    model, x, y, loss = _setup("tied_embedding")
    grads = _oracle(model, _params(model), x, y, loss)
    bounds = [float(n.median()) for n in group_norms(grads, PER_LAYER)]
    clipper = PerSampleClipper(
        model, clipping=engine, max_grad_norm=bounds, clipping_groups="per_layer", augmentation_multiplicity=K
    )
    clipper.backward(_example_losses(model, x, y, loss))
    torch.testing.assert_close(clipper.last_group_norms, group_norms(grads, PER_LAYER), rtol=1e-9, atol=1e-12)
    expected = expected_sum(grads, PER_LAYER, bounds)
    for param_name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[param_name], rtol=1e-9, atol=1e-12, msg=param_name)


@pytest.mark.parametrize("engine", ["flat", "ghost", "mixed"])
def test_per_sample_momentum_over_copies_matches_oracle(engine: str) -> None:
    """DP-PMLF's momentum over 2 iterates of the averaged copies: the past iterate's captures (B K rows) are folded
    into their examples too, and the weighted sum of the example's averaged gradients is clipped once."""
    model, x, y, loss = _setup("conv")
    params = dict(model.named_parameters())
    past = {n: p.detach().clone() for n, p in params.items()}
    generator = torch.Generator().manual_seed(3)
    now = {n: v + 0.3 * torch.randn(v.shape, generator=generator, dtype=v.dtype) for n, v in past.items()}
    weights = momentum_weights(1, 0.6)
    per_iterate = [_oracle(model, state, x, y, loss) for state in (now, past)]
    grads = {n: sum(w * g[n] for w, g in zip(weights, per_iterate, strict=True)) for n in params}
    bound = float(_norms(grads).median())
    clipper = PerSampleClipper(model, clipping=engine, max_grad_norm=bound, augmentation_multiplicity=K)
    momentum = PerSampleMomentum(2, 0.6)
    momentum.bind(clipper)
    momentum.record()
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(now[n])
    momentum.add_past_iterates(clipper, lambda: _example_losses(model, x, y, loss))
    clipper.backward(_example_losses(model, x, y, loss), weight=momentum.current_weight)
    expected = _clipped(grads, bound)
    for param_name, param in params.items():
        torch.testing.assert_close(param.grad, expected[param_name], rtol=1e-9, atol=1e-12, msg=param_name)


@pytest.mark.parametrize("engine", EXACT)
def test_a_non_finite_copy_drops_its_example_only(engine: str) -> None:
    model, x, y, loss = _setup("conv")
    x = x.clone()
    x[2 * K + 1, 0, 1, 1] = math.inf  # the second copy of example 2
    keep = torch.tensor([True, True, False, True, True])
    finite_rows = keep.repeat_interleave(K)
    grads = _oracle(model, _params(model), x.nan_to_num(posinf=0.0), y, loss)
    grads = {n: torch.where(keep.view(-1, *[1] * (g.ndim - 1)), g, 0) for n, g in grads.items()}
    bound = float(_norms(grads)[keep].median())
    clipper = PerSampleClipper(model, clipping=engine, max_grad_norm=bound, augmentation_multiplicity=K)
    norms = clipper.backward(_example_losses(model, x, y, loss))
    assert not math.isfinite(norms[2]) and clipper.dropped_nonfinite and bool(finite_rows.sum() == (B - 1) * K)
    expected = expected_sum(grads, dict.fromkeys(grads, 0), [bound], keep=keep)
    for param_name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[param_name], rtol=1e-9, atol=1e-12, msg=param_name)


def test_a_layer_without_the_copies_is_refused_with_what_to_change() -> None:
    model, x, y, loss = _setup("conv")
    clipper = PerSampleClipper(model, clipping="mixed", max_grad_norm=1.0, augmentation_multiplicity=K)
    with pytest.raises(ValueError, match=r"module 'conv' saw 5 rows .* 15 rows in sample-major order"):
        clipper.backward(loss(model(x[::K]), y[::K]))  # the copies were never made
    with pytest.raises(ValueError, match=r"saw 15 rows but the per-sample loss has 15 examples"):
        clipper.backward(loss(model(x), y))  # one loss per copy, not per example
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="saw a batch dimension of 15 but the per-sample loss has 5 samples"):
        plain = PerSampleClipper(model, clipping="mixed", max_grad_norm=1.0)  # K = 1: the message of before
        plain.backward(_example_losses(model, x, y, loss))


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2"])
def test_invalid_multiplicity_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="augmentation_multiplicity must be an integer >= 1"):
        PerSampleClipper(ConvNet(), max_grad_norm=1.0, augmentation_multiplicity=value)


def test_the_independence_check_sees_copies_in_copy_major_order() -> None:
    """Sample-major rows pass the batch-independence check, which groups each example's K rows of a layer output;
    rows in copy-major order (x.repeat(K, ...)) would clip copies of different examples together, and fail it."""
    for order, fails in (("sample-major", False), ("copy-major", True)):
        model, x, y, loss = _setup("conv")
        clipper = PerSampleClipper(model, max_grad_norm=1.0, augmentation_multiplicity=K)
        if order == "copy-major":  # rows k B + i are example i's; each example's loss the mean of its own rows
            x, y = x.reshape(B, K, *x.shape[1:]).transpose(0, 1).flatten(0, 1), y.reshape(B, K).T.flatten()
            losses = loss(model(x), y).reshape(K, B).mean(0)
        else:
            losses = _example_losses(model, x, y, loss)
        if fails:
            with pytest.raises(BatchMixingError, match=r"with augmentation_multiplicity=3, rows i\*3 .. i\*3\+3-1"):
                check_batch_independence(losses, clipper.output_targets(), copies=K)
        else:
            assert check_batch_independence(losses, clipper.output_targets(), copies=K)
        clipper.detach()


def test_fold_copies_shapes() -> None:
    dense = Factored(torch.randn(6, 2, 3), torch.randn(6, 2, 4), torch.Size([3, 4]))
    folded = fold_copies(dense, 3)
    assert folded.left.shape == (2, 6, 3) and folded.right.shape == (2, 6, 4)
    assert folded.left.data_ptr() == dense.left.data_ptr()  # a view of the captured factor
    torch.testing.assert_close(folded.materialise(), dense.materialise().reshape(2, 3, 3, 4).sum(1))
    ids = Factored(torch.randint(0, 3, (6, 2)), torch.randn(6, 2, 4), torch.Size([3, 4]))
    torch.testing.assert_close(fold_copies(ids, 2).materialise(), ids.materialise().reshape(3, 2, 3, 4).sum(1))
    grad_rows = torch.randn(6, 5)
    torch.testing.assert_close(fold_copies(Materialised(grad_rows), 3).grad, grad_rows.reshape(2, 3, 5).sum(1))
    assert fold_copies(dense, 1) is dense


def test_helpers() -> None:
    batch = {"x": torch.arange(6.0).reshape(3, 2), "y": torch.tensor([0, 1, 2]), "scale": torch.tensor(2.0), "n": 3}
    copies = repeat_for_multiplicity(batch, 2)
    assert torch.equal(copies["y"], torch.tensor([0, 0, 1, 1, 2, 2])) and copies["x"].shape == (6, 2)
    assert copies["scale"] is batch["scale"] and copies["n"] == 3
    assert repeat_for_multiplicity(batch, 1) is batch
    torch.testing.assert_close(augmentation_mean(torch.tensor([1.0, 3.0, 2.0, 4.0]), 2), torch.tensor([2.0, 3.0]))
    with pytest.raises(ValueError, match=r"shape \[B\*K\] with K=2, got \(3,\)"):
        augmentation_mean(torch.ones(3), 2)
    with pytest.raises(ValueError, match="integer >= 1"):
        repeat_for_multiplicity(batch, 0)


def test_augment_each_example_keeps_rows_in_place() -> None:
    """fn sees one example's K copies at a time (never another example's rows); its output goes back in place."""
    batch = {"x": torch.arange(4.0)[:, None].expand(4, 3).clone(), "y": torch.arange(4)}
    rows = repeat_for_multiplicity(batch, 3)
    seen = []

    def fn(copies):
        seen.append(copies["y"].clone())
        return {"x": copies["x"] + torch.arange(float(len(copies["x"])))[:, None], "y": copies["y"]}

    out = augment_each_example(rows, 3, fn)
    assert seen[0].shape == (0,)  # zero copies first, at every draw (all an empty draw has)
    assert all(torch.equal(s, torch.full((3,), i)) for i, s in enumerate(seen[1:]))
    assert torch.equal(out["y"], rows["y"])
    torch.testing.assert_close(out["x"], rows["x"] + torch.arange(3.0).repeat(4)[:, None])
    with pytest.raises(ValueError, match="every tensor of K=3 rows"):
        augment_each_example(rows, 3, lambda c: {"x": c["x"][:1], "y": c["y"]})


def test_repeat_for_multiplicity_refuses_a_tensor_not_of_the_batch() -> None:
    with pytest.raises(ValueError, match=r"position_ids of shape \[1, T\]"):
        repeat_for_multiplicity({"input_ids": torch.zeros(4, 5), "position_ids": torch.zeros(1, 5)}, 2)
