"""The training paths on every device this machine has: CPU always, CUDA where available (skipped otherwise).

What runs differently on a GPU: the model, the per-sample norms and the clipped sums live on the device, the noise
is drawn there from a generator on that device, autocast runs in bf16, and in secure mode a generator on the device
is reseeded from the OS CSPRNG for every draw. Each test runs the same check on each device, so a CPU run of this
file also shows the check is sound; ``tests/clipping/test_clipping.py`` and
``tests/clipping/test_clipping_randomized.py`` hold the per-engine CUDA checks against the torch.func oracle.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from clipping_helpers import oracle_grads, oracle_norms, sin_loss
from helpers import CoshModule, TinyRegressor, ZeroGradModule, make_trainer
from scipy import stats
from torch import nn

import lightning_dp.optim.dp_optimizer as dp_optimizer
from lightning_dp import DPStrategy
from lightning_dp.clipping import PerSampleClipper
from lightning_dp.clipping.engines.base import ENGINES
from lightning_dp.runtime.randomness import DPRandomness

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
EXACT_ENGINES = tuple(name for name, engine in ENGINES.items() if not engine.randomized)
#: Parameters of each mechanism for the noise tests (absolute scales; the Gaussian's is sigma * C).
NOISES = {
    "gaussian": {"noise_multiplier": 1.3},
    "laplace": {"noise_params": {"noise_scale": 2.5}},
    "laplace-advanced": {"noise_params": {"noise_scale": 1.5}},
    "lap2": {"noise_params": {"noise_scale": 0.8}},
    "plrv": {"noise_params": {"gamma_shape": 6.0, "gamma_scale": 0.4}},
}


def _accelerator(device: str) -> str:
    return "gpu" if device == "cuda" else "cpu"


class DeviceRecorder(pl.Callback):
    """The device of every parameter at the end of each training batch (the Trainer moves the module back to the
    CPU when ``fit`` ends, so the device must be read during training)."""

    def __init__(self) -> None:
        self.devices: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.devices |= {p.device.type for p in pl_module.parameters()}


def _fit(module: pl.LightningModule, strategy: DPStrategy, device: str, **kwargs) -> DeviceRecorder:
    recorder = DeviceRecorder()
    make_trainer(strategy, accelerator=_accelerator(device), devices=1, callbacks=[recorder], **kwargs).fit(module)
    return recorder


def _record_noise_generators(monkeypatch) -> list[str]:
    """The device type of every noise generator the run asks for, in order (a spy on ``DPRandomness``)."""
    devices: list[str] = []
    noise_generator = DPRandomness.noise_generator

    def recorded(self, device, *args, **kwargs):
        generator = noise_generator(self, device, *args, **kwargs)
        devices.append(generator.device.type)
        return generator

    monkeypatch.setattr(DPRandomness, "noise_generator", recorded)
    return devices


def _zero_gradient_update(device: str, seed: int, noise: str, monkeypatch, **params) -> torch.Tensor:
    """One step of lr 1 on a zero-gradient layer: the update is the noise divided by q N (100,000 coordinates),
    drawn from generators on the device."""
    with monkeypatch.context() as patch:
        generators = _record_noise_generators(patch)
        module = ZeroGradModule()
        recorder = _fit(module, DPStrategy(max_grad_norm=0.7, noise=noise, seed=seed, **params), device, max_steps=1)
    assert recorder.devices == {device} and generators and set(generators) == {device}
    return module.layer.weight.detach().cpu().flatten()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clipping", list(ENGINES))
def test_noise_free_dp_training_equals_plain_training(device: str, clipping: str) -> None:
    """Without noise and with a bound no gradient reaches, every engine's clipped sum is the plain gradient: six
    steps of DP training on the device end where plain training on it ends."""
    torch.manual_seed(0)
    plain = TinyRegressor(per_sample=False)
    private = TinyRegressor(per_sample=True)
    private.load_state_dict(plain.state_dict())
    make_trainer("auto", accelerator=_accelerator(device), devices=1, max_steps=6).fit(plain)
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=1e6, clipping=clipping, poisson_sampling=False, seed=0)
    assert _fit(private, strategy, device, max_steps=6).devices == {device}
    for a, b in zip(plain.parameters(), private.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("noise", NOISES)
def test_noise_drawn_on_the_device_has_the_cpu_law(device: str, noise: str, monkeypatch) -> None:
    """The update's 100,000 coordinates, drawn by generators on the device, and those drawn on the CPU (another
    seed) come from one law (two-sample Kolmogorov-Smirnov; the CPU laws are tested against their closed forms in
    tests/mechanisms/test_mechanisms_laplace_family.py), and the same seed on the same device gives the same noise."""
    params = NOISES[noise]
    on_device = _zero_gradient_update(device, 1, noise, monkeypatch, **params)
    assert torch.isfinite(on_device).all() and on_device.std() > 0
    on_cpu = _zero_gradient_update("cpu", 2, noise, monkeypatch, **params)
    assert stats.ks_2samp(on_device.double().numpy(), on_cpu.double().numpy()).pvalue > 1e-3
    assert torch.equal(on_device, _zero_gradient_update(device, 1, noise, monkeypatch, **params))


@pytest.mark.parametrize("device", DEVICES)
def test_gaussian_noise_scale_on_the_device(device: str, monkeypatch) -> None:
    """sigma C / (q N) per coordinate, q N the expected batch (100 examples, batch 10)."""
    update = _zero_gradient_update(device, 5, "gaussian", monkeypatch, noise_multiplier=1.3)
    assert update.std().item() == pytest.approx(1.3 * 0.7 / (0.1 * 100), rel=0.02)


@pytest.mark.parametrize("device", DEVICES)
def test_secure_mode_trains_on_the_device(device: str, monkeypatch) -> None:
    """The hardened sampler draws every coordinate's noise on the device, from a generator there reseeded by the OS
    CSPRNG: finite, and two runs differ (no seed can replay it)."""
    sampled_on: list[tuple[str, str]] = []
    secure_sample = dp_optimizer.secure_sample

    def recorded(mechanism, like, generator):
        sampled_on.append((like.device.type, generator.device.type))
        return secure_sample(mechanism, like, generator)

    monkeypatch.setattr(dp_optimizer, "secure_sample", recorded)
    updates = []
    for _ in range(2):
        module = ZeroGradModule()
        strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, secure_mode=True)
        assert _fit(module, strategy, device, max_steps=1).devices == {device}
        updates.append(module.layer.weight.detach().cpu())
    assert sampled_on and set(sampled_on) == {(device, device)}
    assert all(torch.isfinite(u).all() for u in updates) and not torch.equal(*updates)


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_example_is_dropped_on_the_device(device: str) -> None:
    """The overflowing example's inf norm is dropped on the device as on the CPU: the run stays finite. The strategy
    is given the device by name (``"cuda"``, no index)."""
    module = CoshModule()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, device=device)
    assert _fit(module, strategy, device, max_steps=15).devices == {device}
    assert strategy.privacy_engine.dropped_nonfinite
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clipping", EXACT_ENGINES)
def test_bf16_autocast_norms_and_sums_are_float32(device: str, clipping: str) -> None:
    """Under bf16 autocast on the device the norms and the clipped sums are float32 and match the float32 oracle
    within bf16's precision."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3)).to(device)
    x = torch.randn(4, 6, 5, device=device)
    grads = oracle_grads(model, (x,))
    expected = oracle_norms(grads)
    factors = (1.0 / (expected + 1e-6)).clamp(max=1.0)
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=1.0)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = sin_loss(model, (x,))
    norms = clipper.backward(loss)
    assert norms.dtype == torch.float32 and norms.device.type == device
    torch.testing.assert_close(norms, expected, rtol=5e-2, atol=0.0)
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32, name
        clipped_sum = torch.einsum("b,b...->...", factors, grads[name])
        assert (p.grad - clipped_sum).norm() <= 0.05 * clipped_sum.norm(), name  # about 0.6 % at most on a CPU


@pytest.mark.parametrize("device", DEVICES)
def test_dp_trainer_with_lora_equals_the_plain_trainer(device: str, tmp_path) -> None:
    """HF path on the device: a LoRA model, q = 1, a bound no gradient reaches and negligible noise: one DPTrainer
    step (SGD) is the plain Trainer's step, and both ran on the device."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from hf_helpers import TokenDataset, tiny_llama, training_args

    from lightning_dp.hf import DPTrainer, PrivacyArguments

    dataset = TokenDataset(n=8, t=6)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    models, devices = [], []
    for trainer_cls in (transformers.Trainer, DPTrainer):
        model = peft.get_peft_model(tiny_llama(), config)
        for name, param in model.named_parameters():  # LoRA B starts at zero: give A a gradient too
            if "lora_B" in name:
                param.data.fill_(0.1)
        extra = {}
        if trainer_cls is DPTrainer:
            extra["privacy_args"] = PrivacyArguments(
                noise_multiplier=1e-12, per_sample_max_grad_norm=1e6, accountant="rdp", dp_seed=0
            )
        on_cpu = device == "cpu"
        args = training_args(
            tmp_path, per_device_train_batch_size=8, max_steps=1, learning_rate=0.1, optim="sgd", use_cpu=on_cpu
        )
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset, **extra)
        trainer.train()
        devices.append(trainer.args.device.type)
        models.append({n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad})
    assert devices == [device, device]
    plain, private = models
    for name, param in plain.items():
        torch.testing.assert_close(private[name], param, rtol=1e-4, atol=1e-6, msg=name)
