"""Low-pass filter of the noisy gradient (DP-PMLF seed, Algorithm 1 lines 9-11): impulse responses against closed
forms and scipy, bias correction, validation, wiring into DPStrategy / PrivacyEngine / HF, checkpoints."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import scipy.signal
import torch
from helpers import TinyRegressor, make_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_dp import DPStrategy
from lightning_dp.engine.privacy_engine import PrivacyEngine
from lightning_dp.optim import LOWPASS_PRESETS, LowPassFilter, make_lowpass

STEPS = 40


def run(filt: LowPassFilter, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Feed the scalar sequence ``inputs`` (as one float64 tensor per step); return ``(mhat, m)``, where ``m`` is
    recovered as ``mhat * c_m`` (the unnormalised output of line 9)."""
    outputs = []
    for x in inputs:
        grad = torch.tensor([x], dtype=torch.float64)
        filt.apply_([grad])
        outputs.append(grad.item())
    mhat = np.array(outputs)
    return mhat, mhat * filt.bias_corrections(len(inputs))


def impulse(n: int = STEPS) -> np.ndarray:
    x = np.zeros(n)
    x[0] = 1.0
    return x


def closed_form(name: str, t: np.ndarray) -> np.ndarray:
    """Impulse responses of the presets' transfer functions, derived by hand (partial fractions)."""
    if name == "ema":  # 0.1 / (1 - 0.9 z^-1)
        return 0.1 * 0.9**t
    if name == "first-order":  # 0.05 (1 + z^-1) / (1 - 0.9 z^-1)
        return np.where(t == 0, 0.05, 0.05 * 1.9 * 0.9 ** (t - 1.0))
    if name == "second-order":  # 0.01 (1 + z^-1)^2 / (1 - 0.8 z^-1)^2, and 1 / (1 - p z^-1)^2 <-> (t + 1) p^t

        def g(s):
            return np.where(s >= 0, (s + 1.0) * 0.8 ** np.maximum(s, 0.0), 0.0)

        return 0.01 * (g(t) + 2 * g(t - 1) + g(t - 2))
    first_order = {  # b_0 / b_1 over (1 - p z^-1): h_0 = b_0, h_t = (b_0 p + b_1) p^(t-1)
        "pmlf-a9b1": (0.9, 0.1, 0.0),
        "pmlf-a9b0505": (0.9, 0.05, 0.05),
        "pmlf-a9b1505": (0.9, 0.15, -0.05),
        "pmlf-a6b4": (0.6, 0.4, 0.0),
        "pmlf-a6b0202": (0.6, 0.2, 0.2),
        "pmlf-a6b0501": (0.6, 0.5, -0.1),
    }
    if name in first_order:
        p, b0, b1 = first_order[name]
        return np.where(t == 0, b0, (b0 * p + b1) * p ** np.maximum(t - 1.0, 0.0))
    if name == "pmlf-a72b0505":  # 0.05 (1 + z^-1) / ((1 - p1 z^-1)(1 - p2 z^-1)), p1,2 = (0.7 +- sqrt(1.29)) / 2
        p1, p2 = (0.7 + 1.29**0.5) / 2, (0.7 - 1.29**0.5) / 2

        def g(s):
            return np.where(s >= 0, (p1 ** (np.maximum(s, 0.0) + 1) - p2 ** (np.maximum(s, 0.0) + 1)) / (p1 - p2), 0.0)

        return 0.05 * (g(t) + g(t - 1))
    raise KeyError(name)


@pytest.mark.parametrize("name", sorted(LOWPASS_PRESETS))
def test_impulse_response_of_each_preset_equals_its_closed_form_and_scipy(name):
    filt = make_lowpass(name)
    _, m = run(filt, impulse())
    t = np.arange(STEPS, dtype=float)
    np.testing.assert_allclose(m, closed_form(name, t), rtol=1e-12, atol=1e-15)
    reference = scipy.signal.lfilter(filt.b, [1.0, *filt.a], impulse())  # paper's sign convention = scipy's
    np.testing.assert_allclose(m, reference, rtol=1e-12, atol=1e-15)


def test_random_stable_filters_match_scipy_on_random_input():
    rng = np.random.default_rng(0)
    for _ in range(5):
        poles = rng.uniform(-0.95, 0.95, size=2)
        a = np.poly(poles)[1:]  # 1 + a_1 z^-1 + a_2 z^-2 with those poles
        b = rng.uniform(0.2, 1.0, size=3)
        b *= (1 + a.sum()) / b.sum()  # constraint (3)
        filt = LowPassFilter(a.tolist(), b.tolist())
        x = rng.normal(size=STEPS)
        mhat, _ = run(filt, x)
        expected = scipy.signal.lfilter(b, [1.0, *a], x) / scipy.signal.lfilter(b, [1.0, *a], np.ones(STEPS))
        np.testing.assert_allclose(mhat, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(LOWPASS_PRESETS))
def test_constant_input_is_returned_from_the_first_step(name):
    filt = make_lowpass(name)
    constant = [torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([2.5, -1.0])]
    for _ in range(6):
        grads = [c.clone() for c in constant]
        filt.apply_(grads)
        for g, c in zip(grads, constant, strict=True):
            torch.testing.assert_close(g, c, rtol=1e-6, atol=1e-6)


def test_identity_filter_leaves_gradients_unchanged():
    filt = make_lowpass({"a": [], "b": [1.0]})
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(5, generator=gen)
        grads = [x.clone()]
        filt.apply_(grads)
        assert torch.equal(grads[0], x)
    assert filt.state_dict()["m"] == [] and filt.state_dict()["vbar"] == []


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"a": [-0.9], "b": [0.2]}, r"constraint \(3\).*= 1\.1\. Multiply b by .* = 0\.5 "),
        ({"a": [], "b": [0.5, 0.4]}, r"constraint \(3\).*0\.9"),
        ({"a": [-2.0], "b": [-1.0]}, r"unstable.*modulus 2"),
        ({"a": [-1.5, 0.5], "b": [1.0, -1.0]}, r"unstable.*modulus 1"),  # pole on the unit circle
        ({"a": [-0.5], "b": [0.0, 0.5]}, r"c_m,t = 0 vanishes at step t = 0"),
        ({"a": [-0.5], "b": []}, "at least b_0"),
        ({"a": [float("nan")], "b": [1.0]}, "finite"),
        ({"a": ["x"], "b": [1.0]}, "list of numbers"),
        ({"b": [1.0], "c": [1.0]}, "got keys"),
        ("butterworth", r"Unknown lowpass preset 'butterworth'; choose one of \['ema', 'first-order'"),
        (3, "preset name, or a dict"),
    ],
)
def test_bad_filters_are_rejected_with_clear_messages(spec, message):
    with pytest.raises(ValueError, match=message):
        make_lowpass(spec)


def test_layout_change_is_rejected():
    filt = make_lowpass("ema")
    filt.apply_([torch.zeros(3)])
    with pytest.raises(ValueError, match="one filter serves one optimizer"):
        filt.apply_([torch.zeros(4)])


def feed(filt: LowPassFilter, steps: int, seed: int, shapes=((2, 3), (4,))) -> list[list[torch.Tensor]]:
    """Apply ``filt`` to ``steps`` reproducible 'noisy aggregates' of the given shapes; return the filtered ones."""
    gen = torch.Generator().manual_seed(seed)
    outputs = []
    for _ in range(steps):
        grads = [torch.randn(shape, generator=gen) for shape in shapes]
        filt.apply_(grads)
        outputs.append(grads)
    return outputs


def test_state_dict_round_trip_continues_the_same_filter():
    uninterrupted = make_lowpass("second-order")
    feed(uninterrupted, 5, seed=0)
    buffer = io.BytesIO()
    torch.save(uninterrupted.state_dict(), buffer)
    buffer.seek(0)
    restored = make_lowpass("second-order")
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    for a, b in zip(feed(uninterrupted, 6, seed=1), feed(restored, 6, seed=1), strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    with pytest.raises(ValueError, match="resume with the same lowpass"):
        make_lowpass("ema").load_state_dict(uninterrupted.state_dict())


# ------------------------------------------------------------------------------------------------ integration
def test_dp_optimizer_hands_the_filtered_noisy_gradient_to_the_wrapped_optimizer():
    """Noise-free, unclipped: the SGD update must be lr * filter(gradient / (q N)) at every step."""
    torch.manual_seed(0)
    module = TinyRegressor(lr=0.1)
    plain = TinyRegressor(lr=0.1)
    plain.load_state_dict(module.state_dict())
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=1e6, poisson_sampling=False, lowpass="ema")
    recorded: list[list[torch.Tensor]] = []

    class GradRecorder(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            recorded.append([p.grad.detach().clone() for p in pl_module.parameters()])

    make_trainer(strategy, max_steps=4, callbacks=[GradRecorder()]).fit(module)
    # Replay: plain per-sample gradients of the same batches, averaged over the expected batch size, filtered.
    reference = make_lowpass("ema")
    loader = plain.train_dataloader()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step, (x, y) in zip(range(4), loader, strict=False):
        optimizer.zero_grad()
        (((plain.net(x) - y) ** 2).sum() / (strategy.sample_rate * len(plain.data))).backward()
        grads = [p.grad for p in plain.parameters()]
        reference.apply_(grads)
        for got, want in zip(recorded[step], grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        optimizer.step()
    assert strategy.privacy_engine.lowpass.steps == 4


@pytest.mark.parametrize(
    ("noise", "noise_args", "clipping"),
    [
        ("gaussian", {"noise_multiplier": 1.0}, "flat"),
        ("gaussian", {"noise_multiplier": 1.0}, "ghost"),
        ("laplace", {"noise_params": {"noise_scale": 2.0}}, "flat"),
        ("lap2", {"noise_params": {"noise_scale": 2.0}}, "ghost"),  # l1 Laplace needs flat; l2 Laplace here
    ],
)
def test_training_with_lowpass_runs_with_every_mechanism_and_engine_and_costs_no_privacy(noise, noise_args, clipping):
    epsilons = []
    for lowpass in (None, "second-order"):
        module = TinyRegressor()
        before = [p.detach().clone() for p in module.parameters()]
        strategy = DPStrategy(noise=noise, clipping=clipping, max_grad_norm=1.0, seed=0, lowpass=lowpass, **noise_args)
        make_trainer(strategy, max_steps=5).fit(module)
        after = [p.detach().clone() for p in module.parameters()]
        assert all(torch.isfinite(p).all() for p in after)
        assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        summary = strategy.privacy_engine.summary()
        epsilons.append((summary["epsilon"], summary["accountant"]))
    assert summary["lowpass"] == {"name": "second-order", "a": [-1.6, 0.64], "b": [0.01, 0.02, 0.01]}
    assert epsilons[0] == epsilons[1]  # same accountant, same epsilon: the filter is post-processing


def _fit_with_lowpass(tmp_path, max_epochs, ckpt_path=None):
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=3, lowpass="second-order")
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    make_trainer(strategy, max_epochs=max_epochs, callbacks=[checkpoint], enable_checkpointing=True).fit(
        TinyRegressor(), ckpt_path=ckpt_path
    )
    return strategy


def test_filter_state_round_trips_through_a_lightning_checkpoint(tmp_path):
    uninterrupted = _fit_with_lowpass(tmp_path / "part", 2).privacy_engine.lowpass
    (ckpt,) = [p for p in (tmp_path / "part").iterdir() if "epoch=1" in p.name]
    state = torch.load(ckpt, weights_only=False)["lightning_dp"]
    assert "seed" not in json.dumps({k: v for k, v in state.items() if k != "lowpass"})
    assert state["lowpass"]["steps"] == uninterrupted.steps == 2 * 8
    restored = PrivacyEngine(noise_multiplier=1.0, max_grad_norm=1.0, lowpass="second-order")
    restored.load_state_dict(state)
    # The same noisy aggregates after the restore give the same filtered gradients as the uninterrupted filter.
    shapes = [p.shape for p in TinyRegressor().parameters()]
    continued = feed(uninterrupted, 5, seed=7, shapes=shapes)
    for a, b in zip(continued, feed(restored.lowpass, 5, seed=7, shapes=shapes), strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    fresh = feed(make_lowpass("second-order"), 1, seed=7, shapes=shapes)[0]
    assert not torch.equal(fresh[0], continued[0][0])  # the restored state matters
    resumed = _fit_with_lowpass(tmp_path / "resumed", 4, ckpt_path=ckpt)
    assert resumed.privacy_engine.lowpass.steps == 4 * 8
    with pytest.raises(ValueError, match="resume with the same lowpass"):
        strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, lowpass="ema")
        make_trainer(strategy, max_epochs=3).fit(TinyRegressor(), ckpt_path=ckpt)


# ------------------------------------------------------------------------------------------------ HF integration
def test_hf_privacy_arguments_parse_lowpass_from_the_command_line():
    transformers = pytest.importorskip("transformers")
    from lightning_dp.hf import PrivacyArguments

    parser = transformers.HfArgumentParser(PrivacyArguments)
    base = ["--noise_multiplier", "1.0"]
    (as_json,) = parser.parse_args_into_dataclasses([*base, "--lowpass", '{"a": [-0.9], "b": [0.05, 0.05]}'])
    assert as_json.lowpass == {"a": [-0.9], "b": [0.05, 0.05]}
    assert as_json.make_privacy_engine().lowpass.describe()["b"] == [0.05, 0.05]
    (as_name,) = parser.parse_args_into_dataclasses([*base, "--lowpass", "ema"])
    assert as_name.make_privacy_engine().lowpass.name == "ema"
    (off,) = parser.parse_args_into_dataclasses(base)
    assert off.lowpass is None and off.make_privacy_engine().lowpass is None
    with pytest.raises(ValueError, match="JSON object"):
        PrivacyArguments(noise_multiplier=1.0, lowpass='{"a": [-0.9], ')
    with pytest.raises(ValueError, match="constraint"):
        PrivacyArguments(noise_multiplier=1.0, lowpass='{"a": [-0.9], "b": [0.5]}')


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_hf_checkpoint_holds_the_filter_state_and_resume_restores_it(tmp_path):
    pytest.importorskip("transformers")
    from hf_helpers import make_trainer as make_hf_trainer
    from hf_helpers import tiny_gpt2

    from lightning_dp.hf import PrivacyArguments
    from lightning_dp.hf.callbacks import PRIVACY_STATE_NAME, TENSOR_STATE_NAMES

    def privacy():
        return PrivacyArguments(noise_multiplier=1.0, accountant="rdp", dp_seed=0, lowpass="first-order")

    args = dict(max_steps=2, save_strategy="steps", save_steps=2)
    first = make_hf_trainer(tiny_gpt2(), tmp_path, privacy=privacy(), args=args)
    first.train()
    live = first.privacy_engine.lowpass
    folder = tmp_path / "checkpoint-2"
    assert "lowpass" not in json.loads((folder / PRIVACY_STATE_NAME).read_text())
    saved = torch.load(folder / TENSOR_STATE_NAMES["lowpass"], weights_only=True)
    assert saved["steps"] == live.steps == 2
    for lag_saved, lag_live in zip(saved["vbar"], live.state_dict()["vbar"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(lag_saved, lag_live, strict=True))
    resumed = make_hf_trainer(tiny_gpt2(), tmp_path, privacy=privacy(), args={**args, "max_steps": 4})
    resumed.train(resume_from_checkpoint=str(folder))
    assert resumed.privacy_engine.lowpass.steps == 4 and resumed.privacy_engine.steps == 4
    tensors = folder / TENSOR_STATE_NAMES["lowpass"]
    tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])  # a truncated filter state
    damaged = make_hf_trainer(tiny_gpt2(), tmp_path, privacy=privacy(), args={**args, "max_steps": 4})
    with pytest.raises(ValueError, match="truncated or corrupted"):
        damaged.train(resume_from_checkpoint=str(folder))


def test_a_filter_state_whose_history_does_not_fit_is_rejected():
    filt = make_lowpass("second-order")
    for _ in range(3):
        filt.apply_([torch.ones(2)])
    state = filt.state_dict()
    make_lowpass("second-order").load_state_dict(state)
    with pytest.raises(ValueError, match="lowpass state is damaged"):
        make_lowpass("second-order").load_state_dict({**state, "m": state["m"][:1]})


@pytest.mark.parametrize(
    "damage",
    [
        {"steps": "3"},
        {"steps": True},
        {"c_m": ["x", 1.0]},
        {"m": [[1.0], [torch.ones(2)]]},
        {"vbar": ["x"]},
        {"a": None},
        {"c_m": [float("nan"), 1.0]},
        {"m": [[torch.ones(3)], [torch.ones(2)]]},  # lags of other shapes
    ],
)
def test_a_filter_state_of_other_element_types_is_rejected_before_the_run_changes(damage):
    """Checked with the rest, before the ledger is replaced: the load never fails half-way (which would leave it
    begun, so that no checkpoint could be written and the next fit refused)."""
    filt = make_lowpass("second-order")
    for _ in range(3):
        filt.apply_([torch.ones(2)])
    state = filt.state_dict()
    with pytest.raises(ValueError, match="lowpass state is damaged"):
        make_lowpass("second-order").check_state_dict({**state, **damage})
    with pytest.raises(ValueError, match="lowpass state is damaged"):
        make_lowpass("second-order").check_state_dict({k: v for k, v in state.items() if k != "steps"})
    engine = PrivacyEngine(noise_multiplier=1.0, max_grad_norm=1.0, lowpass="second-order")
    saved = {
        "accountant": {"name": "prv", "ledger": []},
        "mechanism": {"name": "gaussian", "noise_multiplier": 1.0, "max_grad_norm": 1.0},
        "target_delta": 1e-5,
        "sample_rate": 0.1,
        "lowpass": {**state, **damage},
    }
    with pytest.raises(ValueError, match="lowpass state is damaged"):
        engine.load_state_dict(saved)
    assert not (engine.state.load_unfinished or engine.state.load_partial)
