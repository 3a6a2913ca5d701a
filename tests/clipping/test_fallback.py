"""The exact torch.func fallback (clipping/layers/fallback.py) for modules that own parameters no layer family covers:
exact against the torch.func oracle under every engine; the same clipped sums as a layer family on the same maths with
groups, augmentation multiplicity, per-sample momentum and a tied weight; refusals for a module that mixes samples,
draws random numbers, branches on its data or returns a tensor without a row per example."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from clipping_helpers import ENGINES, check_against_oracle, oracle_grads, oracle_norms, rand, randomise, sin_loss
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from lightning_dp.checks import BatchMixingError
from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError, find_layer_family
from lightning_dp.optim.momentum import PerSampleMomentum

B = 4


class LearnedScale(nn.Module):
    """``x * scale`` over the last dimension."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class FunctionalLinear(nn.Module):
    """``F.linear`` on its own weight and bias: the maths of ``nn.Linear`` without its class."""

    def __init__(self, weight: nn.Parameter | None = None, bias: bool = True) -> None:
        super().__init__()
        self.weight = weight if weight is not None else nn.Parameter(torch.zeros(3, 4))
        self.bias = nn.Parameter(torch.zeros(self.weight.shape[0])) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class OwnPReLU(nn.PReLU):
    """``nn.PReLU`` with its forward overridden, so the PReLU family does not match it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x >= 0, x, self.weight * x)


class LayerScaleBlock(nn.Module):
    """A residual block with a learned per-channel scale of its own and parameterised children (ConvNext's layer
    scale)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Linear(width, width)
        self.gamma = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * torch.tanh(self.mlp(self.norm(x)))


class MaskedScale(nn.Module):
    """Reads a keyword mask ``[B, T]`` and a shared position table ``[1, T, d]`` that is not batched."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.offset = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return (x + table) * self.scale * mask.unsqueeze(-1) + self.offset


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(5, 6)
        self.masked = MaskedScale(6)
        self.register_buffer("table", torch.linspace(-1, 1, 7 * 6).view(1, 7, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (torch.arange(7) < 5).to(x.dtype).expand(x.shape[0], 7)
        return self.masked(self.inner(x), mask=mask, table=self.table.to(x.dtype))


class ScaledLookup(nn.Module):
    """An embedding table read by indexing, scaled: integer inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(10, 6))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids] * 2.0


class Pair(nn.Module):
    """Returns two tensors with a row per example, as an HF layer returns ``(hidden, attention)``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.offset = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.scale, torch.tanh(x + self.offset)


class PairUser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(5, 4)
        self.pair = Pair()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self.pair(self.inner(x))
        return first * second + first


class Twice(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.tanh(self.layer(x)))


def _ids() -> torch.Tensor:
    return torch.randint(0, 10, (B, 5), generator=torch.Generator().manual_seed(3))


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[torch.Tensor, ...]]]] = {
    "learned_scale": (lambda: nn.Sequential(nn.Linear(5, 4), LearnedScale(4), nn.Linear(4, 3)), lambda: (rand(B, 5),)),
    "learned_scale_tokens": (lambda: nn.Sequential(nn.Linear(5, 4), LearnedScale(4)), lambda: (rand(B, 6, 5),)),
    "functional_linear": (lambda: nn.Sequential(FunctionalLinear(), nn.Tanh(), nn.Linear(3, 2)), lambda: (rand(B, 4),)),
    "functional_linear_tokens": (lambda: FunctionalLinear(bias=False), lambda: (rand(B, 5, 4),)),
    "own_prelu": (lambda: nn.Sequential(nn.Linear(5, 4), OwnPReLU(4)), lambda: (rand(B, 5),)),
    "layer_scale_block": (lambda: nn.Sequential(nn.Linear(5, 6), LayerScaleBlock(6)), lambda: (rand(B, 3, 5),)),
    "keyword_and_shared_inputs": (Masked, lambda: (rand(B, 7, 5),)),
    "integer_inputs": (lambda: nn.Sequential(ScaledLookup(), nn.Linear(6, 2)), lambda: (_ids(),)),
    "tuple_output": (PairUser, lambda: (rand(B, 5),)),
    "called_twice": (lambda: Twice(FunctionalLinear(nn.Parameter(torch.zeros(4, 4)))), lambda: (rand(B, 4),)),
    "weight_norm_conv": (  # Wav2Vec2's positional convolution: parametrized, the originals are its parameters
        lambda: nn.Sequential(weight_norm(nn.Conv1d(2, 3, 3, padding=1), dim=2), nn.Tanh(), nn.Conv1d(3, 2, 1)),
        lambda: (rand(B, 2, 6),),
    ),
    "weight_norm_linear": (lambda: nn.Sequential(weight_norm(nn.Linear(5, 4)), nn.Linear(4, 2)), lambda: (rand(B, 5),)),
}


@pytest.mark.parametrize("clipping", ENGINES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_fallback_matches_oracle(case: str, clipping: str) -> None:
    make_model, make_inputs = CASES[case]
    model = randomise(make_model())
    assert any(find_layer_family(m) is None for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
    check_against_oracle(model, make_inputs(), clipping)


def test_families_stay_the_fast_path_and_the_fallback_is_logged_once(caplog) -> None:
    model = nn.Sequential(nn.Linear(5, 4), nn.PReLU(), LearnedScale(4), OwnPReLU(4))
    assert find_layer_family(model[1]) is not None
    assert find_layer_family(model[2]) is None and find_layer_family(model[3]) is None
    with caplog.at_level(logging.INFO, logger="lightning_dp"):
        PerSampleClipper(model, max_grad_norm=1.0)
    lines = [r.getMessage() for r in caplog.records if "fallback" in r.getMessage()]
    assert len(lines) == 1
    assert "'2' (LearnedScale, 4 parameters)" in lines[0] and "'3' (OwnPReLU, 4 parameters)" in lines[0]
    assert "B x 8" in lines[0] and "'1'" not in lines[0]


class TiedNet(nn.Module):
    """``last(tanh(middle(h)) + tanh(side(h)))``, ``h = tanh(first(x))``, with ``middle`` and ``side`` sharing one
    weight: ``middle`` is an ``nn.Linear`` (the Linear family) or a :class:`FunctionalLinear` (the fallback)."""

    def __init__(self, fallback: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.side, self.last = nn.Linear(4, 4), nn.Linear(4, 3), nn.Linear(3, 4)
        self.middle = FunctionalLinear(self.side.weight) if fallback else nn.Linear(4, 3)
        if not fallback:
            self.middle.weight = self.side.weight
        randomise(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        return self.last(torch.tanh(self.middle(h)) + torch.tanh(self.side(h)))


def _clip_both(
    setup: Callable[[nn.Module], PerSampleClipper], run: Callable[[nn.Module, PerSampleClipper], object]
) -> None:
    results = []
    for model in (TiedNet(fallback=False), TiedNet(fallback=True)):
        clipper = setup(model)
        run(model, clipper)
        results.append([p.grad.clone() for p in model.parameters()])
    for expected, got in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("clipping", ["flat", "ghost", "mixed"])
def test_fallback_equals_the_linear_family_with_groups(clipping: str) -> None:
    x = rand(6, 4)
    _clip_both(
        lambda m: PerSampleClipper(
            m, clipping=clipping, max_grad_norm=[0.3, 0.2, 0.1, 0.2], clipping_groups="per_layer"
        ),
        lambda m, c: c.backward(sin_loss(m, (x,))),
    )


@pytest.mark.parametrize("clipping", ["flat", "ghost", "mixed"])
def test_fallback_equals_the_linear_family_with_augmentation_multiplicity(clipping: str) -> None:
    x = rand(6, 4).repeat_interleave(3, 0) + 0.1 * rand(18, 4, seed=2)

    def loss(m: nn.Module) -> torch.Tensor:
        return sin_loss(m, (x,)).view(6, 3).mean(1)

    _clip_both(
        lambda m: PerSampleClipper(m, clipping=clipping, max_grad_norm=0.2, augmentation_multiplicity=3),
        lambda m, c: c.backward(loss(m)),
    )


@pytest.mark.parametrize("clipping", ["flat", "ghost", "mixed"])
def test_fallback_equals_the_linear_family_with_per_sample_momentum(clipping: str) -> None:
    """The past iterates' terms are formed after the parameters moved: the fallback must use the values at the call."""
    x = rand(6, 4)

    def run(model: nn.Module, clipper: PerSampleClipper) -> None:
        momentum = PerSampleMomentum(3, 0.7)
        momentum.bind(clipper)
        for step in range(2):  # two simulated updates
            momentum.record()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * (step + 1))
        momentum.add_past_iterates(clipper, lambda: sin_loss(model, (x,)))
        clipper.backward(sin_loss(model, (x,)), weight=momentum.current_weight)

    _clip_both(lambda m: PerSampleClipper(m, clipping=clipping, max_grad_norm=0.2), run)


class Centered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.scale
        return h - h.mean(0)


class SlightlyMixing(nn.Module):
    """A linear map of each row plus 1 % of the batch mean: below bfloat16's rounding of the map."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)) / 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.proj + 0.01 * x.mean(0)


class MixesInHalfPrecision(SlightlyMixing):
    """Per-sample in float32; in bfloat16 it adds half the batch mean (a branch on the dtype)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.proj
        return h + 0.5 * h.mean(0) if h.dtype == torch.bfloat16 else h


@pytest.mark.parametrize(
    "mixing",
    [
        # the comparison at bfloat16's tolerance (3e-2) would accept it: the batch and the examples rerun in float32
        pytest.param(SlightlyMixing, id="slightly, refused by the float32 reruns"),
        # the float32 reruns do not mix: the call as it ran under autocast is compared with its autocast rerun too
        pytest.param(MixesInHalfPrecision, id="only in bfloat16, refused by the comparison with the call"),
    ],
)
def test_mixing_under_bfloat16_autocast_is_refused(mixing: type[nn.Module]) -> None:
    model = nn.Sequential(nn.Linear(5, 4), mixing())
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match=rf"'1' \({mixing.__name__}\) is not per-sample"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = model(rand(6, 5).float())
        clipper.backward(output.float().sum(1))


class RotatedByBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.proj = nn.Parameter(torch.randn(4, 4, generator=generator) / 2)
        self.register_buffer("rotation", torch.linalg.qr(torch.randn(4, 4, generator=generator))[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.rotation) @ self.proj


def test_a_bfloat16_model_with_buffers_is_served_under_autocast() -> None:
    # the float32 comparison casts the buffers up with the parameters (a bfloat16 buffer would meet float32 inputs)
    model = nn.Sequential(nn.Linear(5, 4), RotatedByBuffer()).to(torch.bfloat16)
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = model(rand(6, 5).to(torch.bfloat16))
    norms = clipper.backward(output.float().sum(1))
    assert torch.isfinite(norms).all() and (norms > 0).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x * self.scale)


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + torch.empty_like(x).normal_()  # an in-place random fill: not replayed


class Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale if x.sum() > 0 else x


class WithItsScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.scale, self.scale * 2  # the second has no row per example


@pytest.mark.parametrize(
    ("module", "match"),
    [
        (Centered, r"module '1' \(Centered\) is not per-sample.*mixes samples"),
        (Noisy, r"module '1' \(Noisy\) cannot be rerun per sample.*random"),
        (Branching, r"module '1' \(Branching\) cannot be rerun per sample.*branches on its data"),
        (
            WithItsScale,
            r"module '1' \(WithItsScale\).*every tensor its forward returns to have a multiple of the same rows",
        ),
    ],
)
def test_a_module_the_fallback_cannot_serve_is_refused_at_the_first_step(module: type[nn.Module], match: str) -> None:
    model = nn.Sequential(nn.Linear(5, 4), module())
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match=match):
        output = model(rand(6, 5).float())
        clipper.backward((output[0] if isinstance(output, tuple) else output).sum(1))
    assert all(p.grad is None for p in model.parameters())


class TimeMajor(nn.Module):
    """Returns ``[B, T, d]`` and the same rows time-major ``[T B, d]``: sample-major only when ``T = 1``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * self.scale
        return h, h.transpose(0, 1).reshape(-1, x.shape[-1])


class UnfoldsTimeMajor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.time_major = TimeMajor()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, flat = self.time_major(self.inner(x))
        back = flat.reshape(x.shape[1], x.shape[0], -1).transpose(0, 1)  # per-sample as a whole
        return (h * back).sum(1)


def test_a_new_shape_of_the_call_is_compared_again() -> None:
    """The split confirmed for ``T = 1`` (where time-major rows are sample-major) is not trusted for ``T = 3``."""
    model = UnfoldsTimeMajor().double()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    clipper.per_sample_norms(torch.sin(model(rand(4, 1, 4))).sum(1))
    with pytest.raises(UnsupportedModuleError, match=r"'time_major' \(TimeMajor\) is not per-sample"):
        clipper.per_sample_norms(torch.sin(model(rand(4, 3, 4))).sum(1))


def test_an_input_changed_in_place_after_the_call_is_refused() -> None:
    class Shift(nn.Module):  # y = x + shift: autograd saves no input, the capture does
        def __init__(self) -> None:
            super().__init__()
            self.shift = nn.Parameter(torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.shift

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shift = Shift()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(x)
            y = self.shift(h)
            h.mul_(2)
            return y

    model = InPlace()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="modified in place"):
        clipper.backward(model(rand(3, 4)).sum(1))


def test_eval_mode_dropout_is_deterministic_and_served() -> None:
    model = randomise(nn.Sequential(nn.Linear(5, 4), Dropped())).eval()
    check_against_oracle(model, (rand(B, 5),), "mixed")


class WithCodebook(nn.Module):
    """Reads a codebook ``[5, d]`` passed as an argument: not an input per example, even when the batch has 5."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("codebook", torch.linspace(-1, 1, 20).view(5, 4))
        self.inner = Codebook()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x * self.scale, self.codebook.to(x.dtype))


class Codebook(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
        return (x @ codebook.T).tanh() @ codebook * self.weight


def test_the_inputs_split_by_example_are_fixed_once_confirmed() -> None:
    """Confirmed at a batch of 3, the codebook stays whole at a batch of 5, where its rows match the batch's."""
    model = randomise(WithCodebook())
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    clipper.per_sample_norms(sin_loss(model, (rand(3, 4),)))
    x = rand(5, 4, seed=2)
    norms = clipper.per_sample_norms(sin_loss(model, (x,)))
    torch.testing.assert_close(norms, oracle_norms(oracle_grads(model, (x,))), rtol=1e-9, atol=1e-12)


def test_a_new_structure_of_the_call_is_compared_again() -> None:
    """A per-example input that appears after the confirmation (a keyword) is compared before it is trusted."""

    class Cond(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w, self.w2 = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
            return x * self.w + (0 if cond is None else cond.mean(0, keepdim=True) * self.w2)

    model = randomise(Cond())
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    clipper.per_sample_norms(model(rand(3, 4)).sin().sum(1))
    with pytest.raises(UnsupportedModuleError, match="is not per-sample"):
        clipper.per_sample_norms(model(rand(3, 4), cond=rand(3, 4, seed=3)).sin().sum(1))


class Offset(nn.Module):
    """A bias computed from parameters alone, ``[1, d]``."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(1, 4))

    def forward(self) -> torch.Tensor:
        return self.table * 2


class ReadsOffsetRowZero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.offset = nn.Linear(4, 4), Offset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) + self.offset()[0])  # row 0 of the expanded bias for every example


def test_a_bias_of_parameters_read_by_row_zero_is_refused_not_given_to_example_zero() -> None:
    model = randomise(ReadsOffsetRowZero())
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    with pytest.raises(BatchMixingError, match="module 'offset'"):
        clipper.backward(sin_loss(model, (rand(B, 4),)))


def test_the_comparison_waits_for_a_batch_of_two_examples() -> None:
    model = nn.Sequential(nn.Linear(5, 4), Centered())
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    clipper.backward(model(rand(1, 5).float()).sum(1))  # one example: nothing to compare
    with pytest.raises(UnsupportedModuleError, match="is not per-sample"):
        clipper.backward(model(rand(3, 5).float()).sum(1))
