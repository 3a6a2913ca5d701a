"""Adapter conformance: the four trainer adapters (``DPStrategy``, ``DPDDPStrategy``, ``DPModelParallelStrategy``,
``DPTrainer``) implement one contract (:mod:`lightning_dp.engine.adapter`) and keep the same privacy invariants, in
the manner of Lightning's ``tests/tests_pytorch/strategies/test_common.py``.

Every adapter trains the same tiny regression network (``Linear(6, 8) -> Tanh -> Linear(8, 1)``, 4 trainable
tensors) on the same 64 examples, with the same privacy options, on the CPU in this process: ``DPDDPStrategy`` and
``DPModelParallelStrategy`` with ``devices=1`` over gloo (a process group of one; the model of the latter sharded with
``fully_shard`` in ``configure_model``). Checked per adapter:

(a) one Poisson sample per logical step: every micro-batch of an optimizer step comes from the same draw of the
    sampler, each step from a new one, and no draw is left unused (with and without gradient accumulation);
(b) the noise once per step: one ``DPOptimizer.privatise`` per optimizer step, one mechanism draw per trainable tensor
    (each smaller than a piece of noise drawn on the CPU, ``sampling.PIECE``);
(c) equal epsilon for equal configurations: the single-process accountant's epsilon at the run's q and steps;
(d) epsilon continues after resume: 2 steps, a checkpoint, resumed to 4: the steps and epsilon of 4 steps;
(e) the per-sample hooks are removed after fit;
(f) the same start-up block: the engine's own block for the configuration, logged once per fit.

Each fit is run once (module cache) and read by the tests of (a), (b), (c), (e), (f); about a second per fit.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import TinyRegressor, make_trainer, regression_data
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, Dataset

import lightning_dp.data.poisson as poisson_module
from lightning_dp import DPDDPStrategy, DPModelParallelStrategy, DPStrategy, PrivacyEngine
from lightning_dp.accounting.calibration_helpers import epsilon_for
from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent
from lightning_dp.config import HF_NAMES
from lightning_dp.engine.adapter import TrainerAdapter
from lightning_dp.engine.startup import HEADER
from lightning_dp.mechanisms.gaussian import GaussianMechanism
from lightning_dp.optim import DPOptimizer

transformers = pytest.importorskip("transformers")

from hf_helpers import training_args  # noqa: E402

from lightning_dp.hf import DPTrainer, PrivacyArguments  # noqa: E402

ADAPTERS = ("DPStrategy", "DPDDPStrategy", "DPModelParallelStrategy", "DPTrainer")
EXAMPLES, BATCH, NOISE, CLIP, DELTA, LR = 64, 8, 1.0, 1.0, 1e-3, 0.1
#: the privacy options every adapter gets (DPTrainer's under their PrivacyArguments names).
OPTIONS = dict(noise_multiplier=NOISE, max_grad_norm=CLIP, target_delta=DELTA, accountant="rdp", seed=0)
#: OPTIONS with another clipping bound.
HALF_BOUND = {**OPTIONS, "max_grad_norm": CLIP / 2}
TRAINABLE_TENSORS = 4
log = logging.getLogger("lightning_dp")


# ------------------------------------------------------------------------------------------------- the adapters
class ShardedRegressor(TinyRegressor):
    """The tiny regressor, its network sharded with FSDP2 over the data-parallel mesh (of one process)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


def lightning_module(adapter: str) -> TinyRegressor:
    torch.manual_seed(0)
    module_class = ShardedRegressor if adapter == "DPModelParallelStrategy" else TinyRegressor
    return module_class(lr=LR, batch_size=BATCH, data=regression_data(n=EXAMPLES))


def strategy(adapter: str, options: dict[str, Any] = OPTIONS) -> Any:
    if adapter == "DPStrategy":
        return DPStrategy(**options)
    if adapter == "DPDDPStrategy":
        return DPDDPStrategy(process_group_backend="gloo", **options)
    return DPModelParallelStrategy(process_group_backend="gloo", **options)


class Regressor(nn.Module):
    """The same network as :class:`TinyRegressor`'s (same seed), as a plain module for the Trainer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(x)


class RegressionData(Dataset):
    def __init__(self) -> None:
        self.x, self.y = regression_data(n=EXAMPLES).tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class RegressionTrainer(DPTrainer):
    def compute_per_example_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        return ((model(inputs["x"]) - inputs["labels"]) ** 2).squeeze(-1)


def hf_trainer(tmp_path: Path, options: dict[str, Any] = OPTIONS, **args: Any) -> RegressionTrainer:
    privacy = PrivacyArguments(**{HF_NAMES.get(name, name): value for name, value in options.items()})
    arguments = training_args(tmp_path, per_device_train_batch_size=BATCH, learning_rate=LR, optim="sgd", **args)
    return RegressionTrainer(model=Regressor(), args=arguments, train_dataset=RegressionData(), privacy_args=privacy)


# ---------------------------------------------------------------------------------------------- instrumentation
class _CountingTorch:
    """``torch`` for the Poisson sampler's module: ``torch.rand`` (one call per Poisson sample) is counted."""

    def __init__(self, draws: list[int]) -> None:
        self._draws = draws

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def rand(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._draws[0] += 1
        return torch.rand(*args, **kwargs)


@dataclass
class Fit:
    """What one fit did: ``events`` in order (``("micro", draw)`` per clipped micro-batch with the Poisson draw it
    came from, ``("noise",)`` per ``privatise``, ``("sample",)`` per mechanism draw, ``("step",)`` per step of the
    user's optimizer), the number of Poisson draws, the start-up blocks logged, the adapter and the model."""

    adapter: Any
    model: nn.Module
    events: list[tuple] = field(default_factory=list)
    draws: int = 0
    blocks: list[str] = field(default_factory=list)


class _Blocks(logging.Handler):
    def __init__(self, blocks: list[str]) -> None:
        super().__init__(logging.INFO)
        self.blocks = blocks

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if HEADER in message:
            self.blocks.append(message)


def _instrumented(run: Any) -> tuple[list[tuple], int, list[str], Any]:
    """Run ``run()`` with the sampler's draws, the clipped micro-batches, the noise and the optimizer steps recorded."""
    events: list[tuple] = []
    draws, chunks, blocks = [0], [], []
    iterate, clip = poisson_module.PoissonBatchSampler.__iter__, PrivacyEngine.clip
    privatise, sample = DPOptimizer.privatise, GaussianMechanism.sample

    def counting_iter(self):
        for chunk in iterate(self):
            chunks.append(draws[0])  # the draw this micro-batch's indices came from
            yield chunk

    def counting_clip(self, loss, **kwargs):
        events.append(("micro", chunks[sum(1 for e in events if e[0] == "micro")]))
        return clip(self, loss, **kwargs)

    def counting_privatise(self):
        events.append(("noise",))
        return privatise(self)

    def counting_sample(self, like, generator):
        events.append(("sample",))
        return sample(self, like, generator)

    def on_step(optimizer, args, kwargs):
        # torch.distributed.checkpoint creates a stateless optimizer's state (a sharded checkpoint's) with a step()
        # at lr 0 on zero gradients, which neither reads data nor moves the parameters: not a training step
        since = events[len(events) - events[::-1].index(("step",)) :] if ("step",) in events else events
        state_init = ("noise",) not in since and all(
            float(group.get("lr", 1.0)) == 0 for group in optimizer.param_groups
        )
        if not isinstance(optimizer, DPOptimizer) and not state_init:
            events.append(("step",))

    handler, level = _Blocks(blocks), log.level
    # Lightning's DDP set-up writes LOCAL_RANK, MASTER_PORT, ... into os.environ and may set torch's thread count
    environment, threads = dict(os.environ), torch.get_num_threads()
    log.addHandler(handler)
    log.setLevel(logging.INFO)  # the block is an INFO record
    handle = register_optimizer_step_post_hook(on_step)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(poisson_module, "torch", _CountingTorch(draws))
        patch.setattr(poisson_module.PoissonBatchSampler, "__iter__", counting_iter)
        patch.setattr(PrivacyEngine, "clip", counting_clip)
        patch.setattr(DPOptimizer, "privatise", counting_privatise)
        patch.setattr(GaussianMechanism, "sample", counting_sample)
        try:
            result = run()
        finally:
            handle.remove()
            log.removeHandler(handler)
            log.setLevel(level)
            # a LOCAL_RANK left behind makes a later test's two-process launch start one rank and wait for the other
            os.environ.clear()
            os.environ.update(environment)
            torch.set_num_threads(threads)
            if dist.is_available() and dist.is_initialized():  # the one-process group of DPDDP/DPModelParallel
                dist.destroy_process_group()
    return events, draws[0], blocks, result


def fit(
    adapter: str,
    tmp_path: Path,
    *,
    accumulation: int = 1,
    steps: int | None = None,
    resume: Any = None,
    options: dict[str, Any] = OPTIONS,
) -> Fit:
    """One fit of ``adapter`` with the privacy ``options``: one epoch (``steps=None``) or ``steps`` steps, resumed
    from ``resume`` (a checkpoint path) when given; with ``steps`` a checkpoint is written at the end (returned in
    ``adapter``'s ``checkpoint`` attribute of the result's ``adapter`` for Lightning, the Trainer's folder for
    DPTrainer)."""
    if adapter == "DPTrainer":
        length = dict(max_steps=steps) if steps else dict(max_steps=-1, num_train_epochs=1)
        saving = dict(save_strategy="steps", save_steps=steps) if steps else {}
        trainer = hf_trainer(tmp_path, options, gradient_accumulation_steps=accumulation, **length, **saving)
        events, draws, blocks, _ = _instrumented(lambda: trainer.train(resume_from_checkpoint=resume))
        return Fit(trainer, trainer.model, events, draws, blocks)
    module, dp = lightning_module(adapter), strategy(adapter, options)
    length = dict(max_steps=steps) if steps else dict(max_epochs=1)
    trainer = make_trainer(dp, devices=1, accumulate_grad_batches=accumulation, **length)

    def run() -> None:
        trainer.fit(module, ckpt_path=resume)
        if steps:
            trainer.save_checkpoint(tmp_path / "last.ckpt")

    events, draws, blocks, _ = _instrumented(run)
    return Fit(dp, module, events, draws, blocks)


_FITS: dict[tuple[str, int], Fit] = {}


@pytest.fixture(params=ADAPTERS)
def adapter(request) -> str:
    return request.param


@pytest.fixture(params=[1, 2], ids=["one micro-batch", "accumulation 2"])
def epoch(request, adapter, tmp_path_factory) -> tuple[Fit, int]:
    """One epoch of ``adapter`` (``accumulation`` micro-batches of 8 examples per step: q = 8 k / 64), run once."""
    key = (adapter, request.param)
    if key not in _FITS:
        _FITS[key] = fit(adapter, tmp_path_factory.mktemp("fit"), accumulation=request.param)
    return _FITS[key], request.param


def reference_epsilon(sample_rate: float, steps: int) -> float:
    return epsilon_for(PoissonSampledEvent(sample_rate, GaussianEvent(NOISE)), steps, DELTA, "rdp")


def steps_of(events: list[tuple]) -> list[list[tuple]]:
    """The events of each optimizer step (those before its ``("step",)``); none may come after the last step."""
    segments, current = [], []
    for event in events:
        if event == ("step",):
            segments.append(current)
            current = []
        else:
            current.append(event)
    assert current == [], f"events after the last optimizer step: {current}"
    return segments


# ------------------------------------------------------------------------------------------------------ the tests
def test_adapters_expose_the_contract(epoch):
    run, _ = epoch
    assert isinstance(run.adapter, TrainerAdapter)
    engine = run.adapter.privacy_engine
    assert isinstance(engine, PrivacyEngine)
    assert run.adapter.get_epsilon() == engine.epsilon()
    assert run.adapter.privacy_summary() == engine.summary()
    assert (run.adapter.sample_rate, run.adapter.num_samples) == (engine.sample_rate, EXAMPLES)
    assert run.adapter.last_clip_fraction == engine.last_clip_fraction is not None


def test_one_poisson_sample_per_logical_step(epoch):
    run, accumulation = epoch
    segments = steps_of(run.events)
    planned = math.ceil(EXAMPLES / (BATCH * accumulation))  # an epoch is ceil(1/q) logical steps
    assert len(segments) == planned == run.adapter.privacy_engine.steps
    draws = []
    for segment in segments:
        micro = [event[1] for event in segment if event[0] == "micro"]
        assert len(micro) == accumulation and len(set(micro)) == 1, segment  # k micro-batches of one sample
        draws.append(micro[0])
    assert draws == list(range(1, planned + 1))  # a new sample for each step, in order
    assert run.draws == planned  # and none drawn that no step used


def test_noise_once_per_step(epoch):
    run, _ = epoch
    for segment in steps_of(run.events):
        assert sum(event == ("noise",) for event in segment) == 1, segment
        assert sum(event == ("sample",) for event in segment) == TRAINABLE_TENSORS, segment
        noise_at = segment.index(("noise",))
        assert all(event[0] != "micro" for event in segment[noise_at:]), segment  # after the step's last clip


def test_equal_epsilon_for_equal_configurations(epoch):
    run, accumulation = epoch
    engine = run.adapter.privacy_engine
    sample_rate = BATCH * accumulation / EXAMPLES
    assert engine.sample_rate == pytest.approx(sample_rate, rel=1e-12)
    assert engine.target_delta == DELTA and engine.mechanism.noise_multiplier == NOISE
    expected = reference_epsilon(sample_rate, engine.steps)
    assert run.adapter.get_epsilon() == pytest.approx(expected, rel=1e-12)


def _hooks(model: nn.Module) -> list[tuple[str, str, Any]]:
    found = []
    for name, module in model.named_modules():
        for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            found += [(name, kind, hook) for hook in getattr(module, kind).values()]
    for name, parameter in model.named_parameters():
        for kind in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            found += [(name, kind, hook) for hook in (getattr(parameter, kind, None) or {}).values()]
    return found


def _origin(hook: Any) -> str:
    hook = getattr(hook, "func", hook)  # functools.partial
    return getattr(hook, "__module__", None) or type(hook).__module__


def test_hooks_removed_after_fit(epoch):
    run, _ = epoch
    assert run.adapter.privacy_engine.clipper is None and run.adapter.privacy_engine.guard is None
    hooks = _hooks(run.model)
    assert [h for h in hooks if _origin(h[2]).startswith("lightning_dp")] == []
    if not isinstance(run.adapter, DPModelParallelStrategy):  # FSDP2's own hooks stay on a sharded model
        assert hooks == []
    else:
        assert all(_origin(h[2]).startswith("torch.distributed") for h in hooks), hooks


def test_same_startup_block(epoch):
    run, accumulation = epoch
    engine = PrivacyEngine(**OPTIONS)  # the engine alone, as the block describes it for this configuration
    model = Regressor()
    engine.attach(model)
    loader = DataLoader(regression_data(n=EXAMPLES), batch_size=BATCH)
    engine.training_loader(loader, batch_size=BATCH, micro_batches=accumulation)
    engine.prepare(num_samples=EXAMPLES, sample_rate=engine.loader_sample_rate, total_steps=EXAMPLES // BATCH)
    engine.planned_steps = EXAMPLES // (BATCH * accumulation)
    assert run.blocks == ["\n".join(engine.startup_lines())]


def test_epsilon_continues_after_resume(adapter, tmp_path):
    first = fit(adapter, tmp_path, steps=2)
    assert first.adapter.privacy_engine.steps == 2
    checkpoint = tmp_path / ("checkpoint-2" if adapter == "DPTrainer" else "last.ckpt")
    resumed = fit(adapter, tmp_path / "resumed", steps=4, resume=str(checkpoint))
    engine = resumed.adapter.privacy_engine
    assert engine.steps == 4 and len(steps_of(resumed.events)) == 2  # 2 restored, 2 taken
    assert resumed.adapter.get_epsilon() == pytest.approx(reference_epsilon(BATCH / EXAMPLES, 4), rel=1e-12)
    assert len(resumed.blocks) == 1 and "2 taken before this run (restored from the checkpoint)" in resumed.blocks[0]


def test_dp_trainer_s_resume_refusal_names_its_privacy_arguments(tmp_path):
    fit("DPTrainer", tmp_path, steps=2)
    with pytest.raises(ValueError, match=r"trained with per_sample_max_grad_norm=1.0, this run uses 0.5; resume with"):
        fit("DPTrainer", tmp_path / "resumed", steps=4, resume=str(tmp_path / "checkpoint-2"), options=HALF_BOUND)


def test_resume_with_a_target_says_it_keeps_the_checkpoint_s_noise_and_where_the_plan_ends(adapter, tmp_path, caplog):
    """The noise was calibrated for the first run's 2 planned steps; resumed for 4 with the same target_epsilon, the
    start-up block says the target was not used and what the 4 steps reach, which the run then reports."""
    options = {**{k: v for k, v in OPTIONS.items() if k != "noise_multiplier"}, "target_epsilon": 3.0}
    first = fit(adapter, tmp_path, steps=2, options=options)
    checkpoint = tmp_path / ("checkpoint-2" if adapter == "DPTrainer" else "last.ckpt")
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        resumed = fit(adapter, tmp_path / "resumed", steps=4, resume=str(checkpoint), options=options)
    engine = resumed.adapter.privacy_engine
    assert engine.mechanism.describe() == first.adapter.privacy_engine.mechanism.describe()
    reached = resumed.adapter.get_epsilon()
    assert reached > 3.0 and first.adapter.get_epsilon() <= 3.0
    assert (
        f"restored from the checkpoint; target_epsilon=3 not used, the 4 planned steps reach epsilon={reached:.4g}"
        in (resumed.blocks[0])
    )
    assert f"the 4 planned steps reach epsilon={reached:.4g}, above target_epsilon=3" in caplog.text


# ------------------------------------------------------------------------------------------ overrides, statically
def _framework_bases(cls: type) -> list[type]:
    return [base for base in cls.__mro__ if not base.__module__.startswith("lightning_dp") and base is not object]


def _own_methods(cls: type) -> dict[str, Any]:
    methods = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("lightning_dp"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("__") or name in methods:
                continue
            function = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            if inspect.isfunction(function):
                methods[name] = function
    return methods


def _marked_classes() -> list[type]:
    from lightning_dp.hf.averaging import ParameterAveraging
    from lightning_dp.hf.callbacks import PrivacyBudget as HFBudget
    from lightning_dp.hf.callbacks import PrivacyStateCallback
    from lightning_dp.lightning.callbacks import EpochTable, PrivacyAccountantCallback, PrivacyBudget
    from lightning_dp.lightning.progress import TrainingProgress

    callbacks = [PrivacyAccountantCallback, PrivacyBudget, EpochTable, TrainingProgress]
    return [DPStrategy, DPDDPStrategy, DPModelParallelStrategy, DPTrainer, *callbacks, HFBudget, PrivacyStateCallback,
            ParameterAveraging]  # fmt: skip


@pytest.mark.parametrize("cls", _marked_classes(), ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_every_framework_override_is_marked(cls):
    """Each method a ``lightning_dp`` class defines over one of its Lightning/transformers bases carries
    ``@override`` (``typing_extensions.override`` sets ``__override__``)."""
    framework = _framework_bases(cls)
    unmarked = [
        name
        for name, function in _own_methods(cls).items()
        if any(name in vars(base) for base in framework) and not getattr(function, "__override__", False)
    ]
    assert unmarked == []


def test_private_trainer_overrides_are_listed_and_exist():
    """The private ``Trainer`` methods DPTrainer overrides are exactly those of ``PRIVATE_TRAINER_OVERRIDES``, each
    still on the installed ``transformers.Trainer`` with the parameters the override takes."""
    from transformers import Trainer

    from lightning_dp.hf.sharded_checkpoints import PRIVATE_TRAINER_OVERRIDES, TRANSFORMERS_TESTED

    overridden = sorted(name for name in _own_methods(DPTrainer) if name.startswith("_") and hasattr(Trainer, name))
    assert overridden == sorted(PRIVATE_TRAINER_OVERRIDES)
    for name in PRIVATE_TRAINER_OVERRIDES:
        ours = list(inspect.signature(_own_methods(DPTrainer)[name]).parameters)
        theirs = list(inspect.signature(getattr(Trainer, name)).parameters)
        assert ours == theirs, name
    floor, newest = (tuple(int(part) for part in version.split(".")[:2]) for version in TRANSFORMERS_TESTED)
    installed = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    assert floor <= installed, transformers.__version__
    if installed > newest:
        pytest.fail(f"transformers {transformers.__version__} is newer than TRANSFORMERS_TESTED {TRANSFORMERS_TESTED}:"
                    " check the private overrides against it and raise the bound")  # fmt: skip
