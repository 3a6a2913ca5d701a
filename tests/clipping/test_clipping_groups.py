"""Group-wise clipping (``clipping_groups``; He et al. 2022, Section 3): the clipped sums of every exact engine against
a torch.func oracle that clips each group of a per-sample gradient to its own bound (tied weights, per-sample
momentum and non-finite samples included), flat clipping unchanged, the resolution of the groups on a model, and the
settings refused with groups."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from clipping_helpers import PER_LAYER, VOCAB, TiedModel, expected_sum, group_norms, rand, randomise, sin_loss
from torch import nn
from torch.func import functional_call, grad, vmap

from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError
from lightning_dp.clipping.groups import resolve_clipping_groups, sensitivity
from lightning_dp.optim.momentum import PerSampleMomentum, momentum_weights

ENGINES = ("flat", "ghost", "fgc", "mixed")
SEQ, BATCH = 4, 6


PATTERNS = [["emb.*", "head.*"], ["conv.*"], ["norm.*"]]
BY_PATTERNS = {"emb.weight": 0, "head.bias": 0, "conv.weight": 1, "conv.bias": 1, "norm.weight": 2, "norm.bias": 2}


def _model(seed: int = 0) -> TiedModel:
    torch.manual_seed(seed)
    return randomise(TiedModel(), seed)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return ids, torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def _loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).transpose(1, 2), targets, reduction="none").mean(1)


def _oracle(model: nn.Module, params: dict[str, torch.Tensor], ids, targets) -> dict[str, torch.Tensor]:
    """Per-sample gradients ``{name: [B, *shape]}`` at ``params`` (torch.func; the tie is kept by functional_call)."""

    def one(p, x, y):
        return _loss(lambda z: functional_call(model, p, (z,)), x[None], y[None])[0]

    return vmap(grad(one), in_dims=(None, 0, 0))(params, ids, targets)


def _bounds_that_clip_about_half(norms: torch.Tensor) -> list[float]:
    return [float(n.median()) for n in norms]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("spec", "group_of", "list_bounds"),
    [("per_layer", PER_LAYER, True), ("per_layer", PER_LAYER, False), (PATTERNS, BY_PATTERNS, True)],
    ids=["per_layer-list", "per_layer-float", "patterns-list"],
)
def test_group_clipped_sum_matches_oracle(engine, spec, group_of, list_bounds) -> None:
    """Book-keeping (the one-backward path) with the sum check on every batch; the tied head/embedding weight is one
    parameter, clipped in the group of its first owner (per_layer) or of the group matching its names."""
    model, (ids, targets) = _model(), _batch()
    grads = _oracle(model, {n: p.detach() for n, p in model.named_parameters()}, ids, targets)
    norms = group_norms(grads, group_of)
    groups = len(norms)
    if list_bounds:
        bounds = _bounds_that_clip_about_half(norms)
        max_grad_norm: float | list[float] = bounds
    else:
        max_grad_norm = 2.0 * float(norms.median())
        bounds = [max_grad_norm / math.sqrt(groups)] * groups
    clipper = PerSampleClipper(
        model, clipping=engine, max_grad_norm=max_grad_norm, clipping_groups=spec, sum_check_every=1
    )
    assert clipper.groups.bounds == pytest.approx(bounds, rel=1e-15)
    assert clipper.max_grad_norm == pytest.approx(math.sqrt(sum(b * b for b in bounds)), rel=1e-12)

    returned = clipper.per_sample_norms(_loss(model, ids, targets))
    torch.testing.assert_close(returned, norms.square().sum(0).sqrt(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(clipper.last_group_norms, norms, rtol=1e-9, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())

    clipper.backward(_loss(model, ids, targets))
    expected = expected_sum(grads, group_of, bounds)
    clipped = (clipper.last_group_norms > torch.tensor(bounds, dtype=torch.float64)[:, None]).any(0)
    assert 0 < int(clipped.sum()) and torch.equal(clipper.clipped_samples(returned), clipped)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-9, atol=1e-12, msg=name)
    clipper.detach()


@pytest.mark.parametrize("engine", ENGINES)
def test_one_group_of_everything_is_flat_clipping_bit_for_bit(engine) -> None:
    results = []
    for groups in (None, [["*"]]):
        model, (ids, targets) = _model(), _batch()
        clipper = PerSampleClipper(model, clipping=engine, max_grad_norm=0.05, clipping_groups=groups)
        norms = clipper.backward(_loss(model, ids, targets))
        results.append([norms, *(p.grad for p in model.parameters())])
        clipper.detach()
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("engine", ["ghost", "mixed"])
def test_group_clipped_per_sample_momentum_matches_oracle(engine) -> None:
    """DP-PMLF's per-sample momentum over 3 iterates: each group of the weighted sum of per-sample gradients at the
    iterates is clipped to its bound (cross terms between iterates included in the group norms)."""
    model, (ids, targets) = _model(), _batch()
    params = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(1)
    states = [{n: p.detach().clone() for n, p in params.items()}]  # x_0, x_1, x_2 (the current one)
    for _ in range(2):
        states.append(
            {n: v + 0.2 * torch.randn(v.shape, generator=generator, dtype=v.dtype) for n, v in states[-1].items()}
        )
    weights = momentum_weights(2, 0.7)
    per_iterate = [_oracle(model, state, ids, targets) for state in reversed(states)]  # newest first
    grads = {n: sum(w * g[n] for w, g in zip(weights, per_iterate, strict=True)) for n in params}
    bounds = _bounds_that_clip_about_half(group_norms(grads, PER_LAYER))
    clipper = PerSampleClipper(model, clipping=engine, max_grad_norm=bounds, clipping_groups="per_layer")
    momentum = PerSampleMomentum(3, 0.7)
    momentum.bind(clipper)
    for state in states[1:]:  # simulated optimizer steps: record x_t, then move to x_t+1
        momentum.record()
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(state[n])
    current = states[-1]
    momentum.add_past_iterates(clipper, lambda: _loss(model, ids, targets))
    clipper.backward(_loss(model, ids, targets), weight=momentum.current_weight)
    expected = expected_sum(grads, PER_LAYER, bounds)
    for name, param in params.items():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-9, atol=1e-12, msg=name)
        assert torch.equal(param.detach(), current[name])


@pytest.mark.parametrize("engine", ENGINES)
def test_a_non_finite_sample_is_dropped_and_the_others_clipped_per_group(engine) -> None:
    model = randomise(nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)))
    x = rand(6, 5)
    x[2, 1] = math.inf
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(p, xi):
        return sin_loss(lambda z: functional_call(model, p, (z,)), (xi[None],)).sum()

    grads = vmap(grad(one), in_dims=(None, 0))(params, x)
    group_of = {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": 1}
    keep = torch.tensor([True, True, False, True, True, True])
    finite = {n: g[keep] for n, g in grads.items()}
    bounds = _bounds_that_clip_about_half(group_norms(finite, group_of))
    clipper = PerSampleClipper(model, clipping=engine, max_grad_norm=bounds, clipping_groups="per_layer")
    norms = clipper.backward(sin_loss(model, (x,)))
    assert not math.isfinite(norms[2]) and clipper.dropped_nonfinite
    expected = expected_sum(finite, group_of, bounds)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-9, atol=1e-12, msg=name)


def test_the_sum_check_still_sees_a_parameter_used_outside_its_layer() -> None:
    class Outside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) + F.linear(x, self.a.weight))

    model = Outside().double()
    clipper = PerSampleClipper(model, max_grad_norm=[1.0, 1.0], clipping_groups="per_layer", sum_check_every=1)
    with pytest.raises(UnsupportedModuleError, match="do not sum to their batch gradient"):
        clipper.backward(model(rand(3, 4)).squeeze(1))


# ----------------------------------------------------------------------------------------- resolution, refusals
NAMES = [["emb.weight", "head.weight"], ["conv.weight"], ["conv.bias"], ["head.bias"], ["bias"]]


def test_per_layer_groups_follow_the_module_order_and_split_a_number_equally() -> None:
    groups = resolve_clipping_groups("per_layer", 2.0, NAMES)
    assert groups.labels == ("emb", "conv", "head", "(root)")
    assert groups.index == (0, 1, 1, 2, 3)
    assert groups.bounds == (1.0, 1.0, 1.0, 1.0) and groups.sensitivity == 2.0
    assert sensitivity([0.3, 0.4]) == pytest.approx(0.5) and sensitivity(0.7) == 0.7
    assert "4 group(s) (per_layer): emb 1, conv 1, head 1, (root) 1; sensitivity" in groups.describe()


@pytest.mark.parametrize(
    ("spec", "bounds", "match"),
    [
        ("per_layer", [1.0, 1.0], r"2 bounds but .* makes 4 groups on this model, in order \[0: emb, 1: conv, 2: head"),
        ([["emb.*"], ["conv.*"]], 1.0, r"matched by no group: 'head.bias', 'bias'$"),
        ([["emb.*"], ["conv.*"], ["head.*", "bias"]], 1.0, r"'emb.weight' \(groups \[0, 2\]\)"),  # tied: 2 names
        ([["emb.*", "head.*", "bias"], ["conv.*"], ["nothing.*"]], 1.0, r"matching no trainable parameter: 2"),
    ],
)
def test_groups_that_do_not_partition_the_parameters_are_refused(spec, bounds, match) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_clipping_groups(spec, bounds, NAMES)


def test_the_clipper_names_the_layers_when_the_bounds_do_not_fit() -> None:
    with pytest.raises(ValueError, match=r"in order \[0: emb, 1: conv, 2: norm, 3: head\]"):
        PerSampleClipper(_model(), max_grad_norm=[1.0, 2.0], clipping_groups="per_layer")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(max_grad_norm=[1.0, 1.0]), "clipping_groups is not set"),
        (dict(max_grad_norm=[1.0, -1.0], clipping_groups="per_layer"), "positive finite"),
        (dict(max_grad_norm=[], clipping_groups="per_layer"), "positive finite"),
        (dict(clipping_groups="per-layer"), "did you mean 'per_layer'"),
        (dict(clipping_groups=[]), "non-empty list of groups"),
        (dict(clipping_groups=[["a.*"], []]), r"clipping_groups\[1\]"),
        (dict(max_grad_norm=[1.0], clipping_groups=[["a"], ["b"]]), "1 bounds but clipping_groups has 2 groups"),
        (dict(clipping_groups="per_layer", norm=1), "l2 mechanism"),
        (dict(clipping_groups="per_layer", clipping="hutch"), "exact clipping engine"),
    ],
)
def test_the_clipper_refuses_what_groups_do_not_support(options, match) -> None:
    options = {"max_grad_norm": 1.0, **options}
    extra = {"generator_for": lambda device: torch.Generator()} if options.get("clipping") == "hutch" else {}
    with pytest.raises(ValueError, match=match):
        PerSampleClipper(_model(), **options, **extra)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("engine", ["ghost", "mixed"])
def test_groups_of_a_swapped_attention_are_those_of_its_own_parameter_names(engine) -> None:
    """nn.MultiheadAttention is swapped for proxies that register its parameters again: the groups are resolved on
    the model's names before the swap (the packed in-projection in the attention's group, out_proj in its own)."""

    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(6, 2, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, need_weights=False)[0]

    torch.manual_seed(0)
    model = randomise(Attend())
    x = rand(4, 3, 6)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(p, xi):
        return sin_loss(lambda z: functional_call(model, p, (z,)), (xi[None],)).sum()

    grads = vmap(grad(one), in_dims=(None, 0))(params, x)
    group_of = {"attn.in_proj_weight": 0, "attn.in_proj_bias": 0, "attn.out_proj.weight": 1, "attn.out_proj.bias": 1}
    bounds = _bounds_that_clip_about_half(group_norms(grads, group_of))
    clipper = PerSampleClipper(model, clipping=engine, max_grad_norm=bounds, clipping_groups="per_layer")
    assert clipper.groups.labels == ("attn", "attn.out_proj")
    clipper.backward(sin_loss(model, (x,)))
    expected = expected_sum(grads, group_of, bounds)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-9, atol=1e-12, msg=name)
    clipper.detach()


def test_the_clipper_sees_both_names_of_a_tied_weight() -> None:
    """The tied weight's second name (``head.weight``) counts: a group naming only it claims the embedding too."""
    with pytest.raises(ValueError, match=r"'emb.weight' \(groups \[0, 1\]\)"):
        PerSampleClipper(_model(), max_grad_norm=1.0, clipping_groups=[["emb.*", "conv.*", "norm.*"], ["head.*"]])


def test_per_layer_counts_only_layers_with_trainable_parameters() -> None:
    """A frozen layer is no group: a number ``C`` is split over the trainable layers only."""
    model = _model()
    model.conv.requires_grad_(False)
    clipper = PerSampleClipper(model, max_grad_norm=3.0, clipping_groups="per_layer")
    assert clipper.groups.labels == ("emb", "norm", "head") and clipper.groups.bounds == (pytest.approx(3**0.5),) * 3


class _CancellingModel(nn.Module):
    """Every token of a sample is the same row and the per-token weights sum to zero, so ``a``'s per-sample gradient
    cancels to ~1e-5 while ``b``'s does not: the Gram products of the ghost norm round ``a``'s square below 0."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64, bias=False)
        self.b = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ((self.a(x) @ v) * w).sum(1) + self.b(x).sum((1, 2))


@pytest.mark.parametrize("clipping_groups", [None, "per_layer"])
@pytest.mark.parametrize("engine", ["ghost", "mixed"])
def test_a_near_zero_group_rounded_below_zero_gives_a_finite_norm_and_gradient(engine, clipping_groups) -> None:
    torch.manual_seed(0)
    model = _CancellingModel()
    x = torch.randn(8, 1, 64).expand(8, 16, 64).contiguous()
    w = torch.randn(16)
    w = w - w.mean()
    clipper = PerSampleClipper(model, clipping=engine, max_grad_norm=1.0, clipping_groups=clipping_groups)
    norms = clipper.backward(model(x, w, torch.randn(64)))
    assert norms.isfinite().all() and not clipper.dropped_nonfinite
    assert all(p.grad.isfinite().all() for p in model.parameters())
    if clipping_groups is not None:
        assert clipper.last_group_norms.isfinite().all()
