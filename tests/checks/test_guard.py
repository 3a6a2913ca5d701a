"""Leaks the clipping hooks cannot see (docs/design.md section 9): embedding max_norm, buffers written in the forward,
operations that mix examples."""

from __future__ import annotations

import pytest
import torch
from helpers import ClassifierWith, TinyRegressor, make_trainer
from hf_helpers import TokenDataset, tiny_bert_classifier, tiny_gpt2, tiny_llama
from hf_helpers import make_trainer as make_hf_trainer
from torch import nn

from lightning_dp.checks.buffers import BufferWatch
from lightning_dp.checks.guard import TrainingGuard
from lightning_dp.checks.independence import BatchMixingError, check_batch_independence, input_leaves
from lightning_dp.checks.leave_half_out import LEAVE_HALF_OUT_FORWARDS
from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError
from lightning_dp.lightning import DPStrategy


class Centered(nn.Module):
    """``h - h.mean(0)`` between two linear layers: no parameter, but every example moves every other's loss."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 4), nn.Linear(4, 1)

    def forward(self, x):
        h = self.a(x)
        return self.b(h - h.mean(0))


class InputCentered(nn.Module):
    """Mixing before any layer: only the float-input leaf can see it."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 1)

    def forward(self, x):
        return self.lin(x - x.mean(0))


class RunningMean(nn.Module):
    """A hand-written running mean, stored in a buffer from the data."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 1)
        self.register_buffer("running", torch.zeros(d))

    def forward(self, x):
        if self.training:
            self.running.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.lin(x)


class ReassignedMean(RunningMean):
    def forward(self, x):
        self.running = 0.9 * self.running + 0.1 * x.detach().mean(0)
        return self.lin(x)


class DataCopiedMean(RunningMean):
    """Written through ``.data``: that alias has its own version counter, only the contents show the write."""

    def forward(self, x):
        self.running.data.copy_(x.detach().mean(0))
        return self.lin(x)


class DataAssignedMean(RunningMean):
    def forward(self, x):
        self.running.data = x.detach().mean(0)
        return self.lin(x)


class FrozenStatistic(nn.Module):
    """A frozen parameter written from the data under ``no_grad``."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 1)
        self.stat = nn.Parameter(torch.zeros(d), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.stat.copy_(x.mean(0))
        return self.lin(x)


@pytest.mark.parametrize("embedding", [nn.Embedding(10, 4, max_norm=1.0), nn.EmbeddingBag(10, 4, max_norm=1.0)])
@pytest.mark.parametrize("frozen", [False, True])
def test_embedding_max_norm_is_rejected_trainable_or_frozen(embedding, frozen):
    model = nn.Sequential(embedding, nn.Linear(4, 1))
    embedding.weight.requires_grad_(not frozen)
    with pytest.raises(UnsupportedModuleError, match=r"'0'.*max_norm=1\.0.*in place.*max_norm=None"):
        PerSampleClipper(model, max_grad_norm=1.0)


@pytest.mark.parametrize(
    ("body", "name"),
    [
        (RunningMean(), "running"),
        (ReassignedMean(), "running"),
        (DataCopiedMean(), "running"),
        (DataAssignedMean(), "running"),
        (FrozenStatistic(), "stat"),
    ],
)
@pytest.mark.parametrize("check_independence", [True, False])
def test_buffer_or_frozen_parameter_written_in_training_forward_is_rejected(body, name, check_independence):
    strategy = DPStrategy(noise_multiplier=1.0, check_batch_independence=check_independence)
    trainer = make_trainer(strategy, max_steps=2)
    with pytest.raises(UnsupportedModuleError, match=rf"'{name}' of module 'body'.*running mean"):
        trainer.fit(ClassifierWith(body))


@pytest.mark.parametrize("exact_up_to", [2**16, 0])
def test_data_writes_are_caught_by_exact_compare_and_by_checksum(monkeypatch, exact_up_to):
    import lightning_dp.checks.buffers as buffers

    monkeypatch.setattr(buffers, "EXACT_COMPARE_NUMEL", exact_up_to)
    body = DataCopiedMean()
    watch = buffers.BufferWatch(body)
    watch.start(contents=True)
    body(torch.randn(4, 6))
    with pytest.raises(UnsupportedModuleError, match="'running' of module '<root>'"):
        watch.check()
    watch.start()  # ids, versions and addresses only: a write through .data is not seen
    body(torch.randn(4, 6))
    watch.check()


def test_buffer_watch_compares_the_contents_of_a_weight_peft_adapts_on_every_step():
    """peft's ``ParamWrapper`` (LoRA through ``target_parameters``) ``set_``s the weight it adapts to itself in every
    forward: not a write; a write to that weight on a later step is still caught, by its contents."""
    peft = pytest.importorskip("peft")
    body = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 1))
    model = peft.get_peft_model(body, peft.LoraConfig(r=2, target_modules=[], target_parameters=["0.weight"]))
    weight = body[0].weight
    watch = BufferWatch(model)
    for contents in (True, False):  # the first step, a later one
        watch.start(contents=contents)
        before = weight._version
        model(torch.randn(4, 6))
        assert weight._version > before  # peft's set_
        watch.check()
    watch.start()
    with torch.no_grad():
        weight.data.add_(1.0)  # through .data: neither identity, version nor address show it
    with pytest.raises(UnsupportedModuleError, match=r"'weight' of module 'base_model\.model\.0"):
        watch.check()


def test_buffer_watch_is_silent_for_unchanged_buffers_and_frozen_parameters():
    body = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 1))
    body[0].requires_grad_(False)
    body.register_buffer("constant", torch.tensor([1.0, float("nan")]))
    make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=2).fit(ClassifierWith(body))


@pytest.mark.parametrize("body", [Centered(), InputCentered()])
def test_batch_mixing_fails_on_the_first_step(body):
    module = ClassifierWith(body)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    # seeded: an unseeded first Poisson batch of fewer than 2 examples (rare) would postpone the check past an update
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=2)
    with pytest.raises(BatchMixingError, match=r"example \d+'s .*h - h\.mean\(0\).*check_batch_independence=False"):
        trainer.fit(module)
    for key, value in module.state_dict().items():  # failed before any update
        torch.testing.assert_close(value, before[key])


def test_batch_mixing_check_can_be_switched_off():
    strategy = DPStrategy(noise_multiplier=1.0, check_batch_independence=False)
    make_trainer(strategy, max_steps=2).fit(ClassifierWith(Centered()))
    assert strategy.privacy_engine.steps == 2


def test_normal_models_pass_and_the_check_runs_once(monkeypatch):
    import lightning_dp.checks.guard as guard

    calls = []
    original = guard.check_batch_independence
    monkeypatch.setattr(guard, "check_batch_independence", lambda *a: calls.append(1) or original(*a))
    make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=3).fit(TinyRegressor())
    assert calls == [1]


def test_every_pair_is_tested():
    """A coupling of only the last two examples (indices 6 and 7 of 8) is found."""
    x = torch.randn(8, 3, requires_grad=True)
    w = torch.randn(3)
    out = x @ w
    coupled = torch.cat([out[:6], out[6:].sum().expand(2)])
    with pytest.raises(BatchMixingError, match="example [67]'s x"):
        check_batch_independence(coupled**2, {"x": (x, x.shape)})
    check_batch_independence((x @ w) ** 2, {"x": (x, x.shape)})  # independent: passes


def test_independence_check_that_cannot_run_warns(caplog):
    x = torch.randn(4, 3, requires_grad=True)
    with caplog.at_level("WARNING", logger="lightning_dp"):
        check_batch_independence((x @ torch.randn(3)).detach(), {"x": (x, x.shape)})
        check_batch_independence((x @ torch.randn(3)) ** 2, {"x": (x[:2], torch.Size([2, 3]))})
    assert "could not run (the per-sample loss has no gradient)" in caplog.text
    assert "no hooked layer output or float input has the batch size 4" in caplog.text


def test_guard_warns_once_when_the_batch_size_is_unknown(caplog):
    model = nn.Linear(6, 1)
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    guard = TrainingGuard(model, clipper.output_targets)
    with caplog.at_level("WARNING", logger="lightning_dp"):
        for _ in range(2):
            guard.after_forward(model(guard.before_forward(torch.randn(1, 6), None)).squeeze(-1))
            clipper._hooks.clear()
    assert caplog.text.count("batch size could not be read") == 1


def test_input_leaves_only_float_batch_tensors():
    x, ids, y = torch.randn(4, 2), torch.arange(4), torch.randn(3)
    batch, leaves = input_leaves({"x": x, "ids": ids, "other": y}, 4)
    assert list(leaves) == ["input 0"] and leaves["input 0"].requires_grad
    assert batch["ids"] is ids and batch["other"] is y and batch["x"].grad_fn is not None


def test_guard_skips_single_example_batches_until_a_larger_one():
    model = Centered()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    guard = TrainingGuard(model, clipper.output_targets)
    x = guard.before_forward(torch.randn(1, 6), 1)
    guard.after_forward(model(x).squeeze(-1))
    assert guard.independence_pending
    clipper._hooks.clear()
    x = guard.before_forward(torch.randn(4, 6), 4)
    with pytest.raises(BatchMixingError):
        guard.after_forward(model(x).squeeze(-1))


@pytest.mark.parametrize("factory", [tiny_gpt2, tiny_llama, tiny_bert_classifier])
def test_hf_tiny_models_pass(tmp_path, factory, monkeypatch):
    import lightning_dp.checks.guard as guard

    calls = []
    original = guard.check_batch_independence
    monkeypatch.setattr(guard, "check_batch_independence", lambda *a: calls.append(len(a[1])) or original(*a))
    task = "cls" if factory is tiny_bert_classifier else "lm"
    trainer = make_hf_trainer(factory(), tmp_path, TokenDataset(task=task), args={"max_steps": 2})
    trainer.train()
    assert trainer.privacy_engine.steps == 2
    assert len(calls) == 1 and calls[0] > 3  # ran once, over the hooked layer outputs


def test_hf_batch_mixing_is_caught(tmp_path):
    """Mixing after the embeddings (in the dropout that follows them, a module without parameters)."""
    model = tiny_gpt2()

    def mix(module, args, output):
        return output - output.mean(0, keepdim=True)

    model.transformer.drop.register_forward_hook(mix)
    with pytest.raises(BatchMixingError, match="example .*'s output of module 'transformer.w[tp]e'"):
        make_hf_trainer(model, tmp_path, TokenDataset(), args={"max_steps": 1}).train()  # the attach probe sees it


def test_hf_frozen_parameter_written_through_data_is_caught(tmp_path):
    """A frozen final layer norm whose weight a forward hook overwrites from the data through ``.data``."""
    model = tiny_gpt2()
    model.transformer.ln_f.requires_grad_(False)

    def write(module, args, output):
        module.weight.data.copy_(output.detach().mean((0, 1)))

    model.transformer.ln_f.register_forward_hook(write)
    trainer = make_hf_trainer(model, tmp_path, TokenDataset(), args={"max_steps": 1})
    with pytest.raises(UnsupportedModuleError, match="'weight' of module 'transformer.ln_f'"):
        trainer.train()


class DetachedCentered(Centered):
    """``h - h.mean(0).detach()``: no gradient path between examples, so only the leave-half-out forward sees it."""

    def forward(self, x):
        h = self.a(x)
        return self.b(h - h.mean(0).detach())


class BatchNormalisedLoss(ClassifierWith):
    """Per-sample losses divided by the batch's total "token count" (a common LM pattern that mixes examples)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        tokens = torch.ones_like(x)  # every feature a "token"
        err = (self.body(x) - y.expand(-1, 1)) ** 2
        return (err * tokens).sum(1) / tokens.sum()


@pytest.mark.parametrize("module", [ClassifierWith(DetachedCentered()), BatchNormalisedLoss(nn.Linear(6, 1))])
def test_mixing_without_a_gradient_path_is_caught_by_the_leave_half_out_forward(module):
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=2)
    with pytest.raises(BatchMixingError, match=r"leave-half-out check: .*per-example mean"):
        trainer.fit(module)


def test_leave_half_out_runs_once_in_eval_mode_without_logging(monkeypatch):
    import lightning_dp.checks.guard as guard

    calls, modes = [], []
    original = guard.check_leave_half_out

    def spy(compute_loss, batch, batch_size, module):
        calls.append(batch_size)
        return original(lambda b: modes.append(module.training) or compute_loss(b), batch, batch_size, module)

    monkeypatch.setattr(guard, "check_leave_half_out", spy)
    module = TinyRegressor()
    make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=3).fit(module)
    assert len(calls) == 1 and calls[0] >= 2 and modes == [False] * LEAVE_HALF_OUT_FORWARDS and module.training


# ------------------------------------------------------------------------- the periodic check (every N steps)
class LateCentered(nn.Module):
    """``h - h.mean(0)`` from its ``start``-th forward in training mode on (a schedule that starts mixing later)."""

    def __init__(self, start: int = 5, d: int = 6) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 4), nn.Linear(4, 1)
        self.start, self.calls = start, 0

    def forward(self, x):
        h = self.a(x)
        if self.training:
            self.calls += 1
            if self.calls >= self.start:
                h = h - h.mean(0)
        return self.b(h)


def _spy_checks(monkeypatch) -> dict[str, list[int]]:
    """Record the batch size of every gradient and leave-half-out check."""
    import lightning_dp.checks.guard as guard

    calls: dict[str, list[int]] = {"gradient": [], "leave_half_out": []}
    gradient, half = guard.check_batch_independence, guard.check_leave_half_out
    monkeypatch.setattr(
        guard, "check_batch_independence", lambda *a: calls["gradient"].append(len(a[0])) or gradient(*a)
    )
    monkeypatch.setattr(guard, "check_leave_half_out", lambda *a: calls["leave_half_out"].append(a[2]) or half(*a))
    return calls


@pytest.mark.parametrize(("every", "caught_after"), [(None, None), (1, 4), (2, 4), (3, 6)])
def test_mixing_that_starts_later_is_missed_on_the_first_step_and_caught_by_the_periodic_check(every, caught_after):
    """Mixing from the 5th step (after 4 optimizer steps): the first-step check passes it and training completes;
    every 1 or 2 steps it is caught on that step, every 3 steps on the next checked one (after 6 steps)."""
    torch.manual_seed(0)
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_batch_independence_every=every)
    trainer = make_trainer(strategy, max_steps=8)
    if caught_after is None:
        trainer.fit(ClassifierWith(LateCentered()))
        assert strategy.privacy_engine.steps == 8
        return
    message = rf"batch-independence check after {caught_after} optimizer steps: .*example \d+'s .*h - h\.mean\(0\)"
    with pytest.raises(BatchMixingError, match=message + ".*check_batch_independence=False"):
        trainer.fit(ClassifierWith(LateCentered()))
    assert strategy.privacy_engine.steps == caught_after  # raised before that step's update


@pytest.mark.parametrize("options", [{"momentum_length": 2}, {"accumulate_grad_batches": 2}])
@pytest.mark.parametrize("every", [None, 1])
def test_late_mixing_with_momentum_or_accumulation(options, every):
    """With per-sample momentum (k forwards per batch) and with gradient accumulation (k micro-batches per step)
    the first-step check misses the late mixing and the periodic one catches it."""
    options = dict(options)
    trainer_options = {"accumulate_grad_batches": options.pop("accumulate_grad_batches", 1)}
    torch.manual_seed(0)
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_batch_independence_every=every, **options)
    trainer = make_trainer(strategy, max_steps=6, **trainer_options)
    if every is None:
        trainer.fit(ClassifierWith(LateCentered()))
        assert strategy.privacy_engine.steps == 6
    else:
        with pytest.raises(BatchMixingError, match=r"check after [1-5] optimizer steps: .*h - h\.mean\(0\)"):
            trainer.fit(ClassifierWith(LateCentered()))


@pytest.mark.parametrize(
    "options", [{}, {"momentum_length": 2}, {"accumulate_grad_batches": 2}, {"clipping": "ghost"}], ids=str
)
def test_periodic_check_leaves_the_update_bit_identical(monkeypatch, options):
    """An independent model trains to the same parameters, bit for bit, with the check on every step as with the
    first-step check only (same seeds): the check draws no DP randomness and does not change the update. The checks
    run once per optimizer step (on one micro-batch of each step with accumulation)."""
    options = dict(options)
    trainer_options = {"accumulate_grad_batches": options.pop("accumulate_grad_batches", 1)}
    params = []
    for every in (None, 1):
        calls = _spy_checks(monkeypatch)
        torch.manual_seed(0)
        module = TinyRegressor()
        strategy = DPStrategy(noise_multiplier=1.0, seed=0, check_batch_independence_every=every, **options)
        make_trainer(strategy, max_steps=6, **trainer_options).fit(module)
        assert strategy.privacy_engine.steps == 6
        assert len(calls["gradient"]) == len(calls["leave_half_out"]) == (1 if every is None else 6)
        params.append([p.detach().clone() for p in module.parameters()])
    for without, with_check in zip(*params, strict=True):
        assert torch.equal(without, with_check)


class _Steps:
    """A stand-in for the engine's step count."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> int:
        return self.count


def test_guard_arms_due_steps_once_on_their_first_micro_batch_with_two_examples(monkeypatch):
    """check_every=2, two micro-batches per step: the checks run on the first micro-batch of steps 0, 2, 4; at step
    2 the first micro-batch has one example, so they run on the second; never twice in a step."""
    calls = _spy_checks(monkeypatch)
    model = nn.Linear(6, 1)
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    steps = _Steps()
    guard = TrainingGuard(model, clipper.output_targets, check_every=2, step=steps)
    checked = []
    for step in range(6):
        steps.count = step
        for micro in range(2):
            size = 1 if (step, micro) == (2, 0) else 4
            before = len(calls["gradient"])
            batch = torch.randn(size, 6)
            loss = model(guard.before_forward(batch, size)).squeeze(-1)
            guard.after_forward(loss)
            guard.leave_half_out(lambda b: model(b).squeeze(-1), batch, size, model)
            clipper._hooks.clear()
            if len(calls["gradient"]) > before:
                checked.append((step, micro))
    assert checked == [(0, 0), (2, 1), (4, 0)]
    assert calls["leave_half_out"] == [4, 4, 4]


def test_periodic_failure_names_the_step():
    model = Centered()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    steps = _Steps()
    steps.count = 6
    guard = TrainingGuard(model, clipper.output_targets, check_every=3, step=steps)
    x = guard.before_forward(torch.randn(4, 6), 4)
    with pytest.raises(BatchMixingError, match=r"^batch-independence check after 6 optimizer steps: the losses"):
        guard.after_forward(model(x).squeeze(-1))


@pytest.mark.parametrize("every", [0, -2, 1.5, True, "3"])
def test_check_every_must_be_a_positive_int_or_none(every):
    from lightning_dp import PrivacyEngine
    from lightning_dp.hf import PrivacyArguments

    message = "check_batch_independence_every must be a positive whole number of optimizer steps or None"
    for make in (
        lambda: DPStrategy(noise_multiplier=1.0, check_batch_independence_every=every),
        lambda: PrivacyEngine(max_grad_norm=1.0, noise_multiplier=1.0, check_batch_independence_every=every),
        lambda: PrivacyArguments(noise_multiplier=1.0, check_batch_independence_every=every),
    ):
        with pytest.raises(ValueError, match=message):
            make()


def test_check_every_needs_the_check_on():
    from lightning_dp.hf import PrivacyArguments

    message = r"check_batch_independence_every=5 .* set check_batch_independence=True .* or check_batch_independence_"
    with pytest.raises(ValueError, match=message):
        DPStrategy(noise_multiplier=1.0, check_batch_independence=False, check_batch_independence_every=5)
    with pytest.raises(ValueError, match=message):
        PrivacyArguments(noise_multiplier=1.0, check_batch_independence=False, check_batch_independence_every=5)
    strategy = DPStrategy(noise_multiplier=1.0, check_batch_independence_every=5)
    assert strategy.privacy_engine.check_batch_independence_every == 5


def _late_mixing_hook(steps, start: int = 5):
    """A forward hook on a module without parameters: ``output - output.mean(0)`` in training mode from the forward of
    optimizer step ``start`` (``steps()``, the steps taken) on."""

    def mix(module, args, output):
        if not module.training or steps() < start - 1:
            return output
        return output - output.mean(0, keepdim=True)

    return mix


@pytest.mark.parametrize("every", [None, 1, 2])
def test_hf_mixing_that_starts_later_is_caught_by_the_periodic_check(tmp_path, every):
    from lightning_dp.hf import PrivacyArguments

    model = tiny_gpt2()
    privacy = PrivacyArguments(noise_multiplier=1.0, accountant="rdp", dp_seed=0, check_batch_independence_every=every)
    trainer = make_hf_trainer(model, tmp_path, TokenDataset(), privacy=privacy, args={"max_steps": 7})
    model.transformer.drop.register_forward_hook(_late_mixing_hook(lambda: trainer.privacy_engine.steps))
    if every is None:
        trainer.train()
        assert trainer.privacy_engine.steps == 7
        return
    with pytest.raises(BatchMixingError, match=r"check after 4 optimizer steps: .*example .*'s output of module"):
        trainer.train()


@pytest.mark.parametrize("accumulation", [1, 2])
def test_hf_periodic_check_leaves_the_update_bit_identical(tmp_path, monkeypatch, accumulation):
    from hf_helpers import trainable_snapshot

    from lightning_dp.hf import PrivacyArguments

    params = []
    for every in (None, 1):
        calls = _spy_checks(monkeypatch)
        privacy = PrivacyArguments(
            noise_multiplier=1.0, accountant="rdp", dp_seed=0, check_batch_independence_every=every
        )
        args = {"max_steps": 3, "gradient_accumulation_steps": accumulation, "per_device_train_batch_size": 8}
        trainer = make_hf_trainer(tiny_gpt2(), tmp_path / str(every), TokenDataset(), privacy=privacy, args=args)
        trainer.train()
        assert len(calls["gradient"]) == len(calls["leave_half_out"]) == (1 if every is None else 3)
        params.append(trainable_snapshot(trainer.model))
    assert params[0].keys() == params[1].keys()
    for name, value in params[0].items():
        assert torch.equal(value, params[1][name]), name


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        # off: no collective at all
        (dict(check_batch_independence=False), []),
        # first step only: the step's three agreements (passes, errors, what is pending), then none
        (dict(), [(0, 0, "bits"), (0, 0, "error"), (0, 0, "run"), (0, 0, "error"), (0, 0, "pending")]),
        # every 2 steps: the same on steps 0 and 2, nothing in between
        (
            dict(check_every=2),
            [(s, 0, what) for s in (0, 2) for what in ("bits", "error", "run", "error", "pending")],
        ),
    ],
    ids=["off", "first-step", "every-2"],
)
def test_lockstep_agreements_stop_once_no_rank_has_a_check_pending(options, expected):
    """On a sharded model the checks run in lockstep over the ranks (here one rank: the agreement is the identity);
    the small all-reduces run only while a check may be pending somewhere, not on every micro-batch of the run."""
    model = nn.Linear(6, 1)
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    steps = _Steps()
    check = options.pop("check_batch_independence", True)
    guard = TrainingGuard(model, clipper.output_targets, check_batch_independence=check, step=steps, **options)
    calls: list[tuple[int, int, str]] = []
    where = {"micro": 0, "names": iter(())}

    def lockstep(values: list[int]) -> list[int]:
        calls.append((steps.count, where["micro"], next(where["names"])))
        return values

    guard.lockstep = lockstep
    for step in range(4):
        steps.count = step
        for micro in range(2):
            where.update(micro=micro, names=iter(("bits", "error", "run", "error", "pending")))
            batch = torch.randn(4, 6)
            loss = model(guard.before_forward(batch, 4)).squeeze(-1)
            guard.after_forward(loss)
            guard.leave_half_out(lambda b: model(b).squeeze(-1), batch, 4, model)
            clipper._hooks.clear()
    assert calls == expected
