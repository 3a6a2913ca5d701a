"""Parameter averaging (EMA of the weights, De et al. 2022) for the HF Trainer: ``ParameterAveraging`` against a hand
computation over the recorded DP iterates, evaluation with the average while training continues from the iterate,
the average in the final model and in checkpoints, exact resume, LoRA adapters only."""

from __future__ import annotations

import math

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_helpers import TokenDataset, make_trainer, tiny_bert_classifier, tiny_gpt2, training_args  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from lightning_dp.hf import ParameterAveraging, PrivacyArguments, PrivacyBudget  # noqa: E402
from lightning_dp.hf.averaging import AVERAGING_STATE_NAME  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

Weights = dict[str, torch.Tensor]


def trainable(model: torch.nn.Module) -> Weights:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def ema(iterates: list[Weights], decay: float) -> Weights:
    """The average by hand: the first iterate, then ``decay * average + (1 - decay) * iterate``."""
    average = iterates[0]
    for iterate in iterates[1:]:
        average = {name: decay * average[name] + (1 - decay) * value for name, value in iterate.items()}
    return average


def assert_weights(model: torch.nn.Module, expected: Weights, atol: float = 0.0) -> None:
    held = trainable(model)
    assert held.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(held[name], value, rtol=0, atol=atol, msg=name)


class IterateRecorder(TrainerCallback):
    """The trainable parameters after every optimizer step (listed before ``ParameterAveraging``: the iterate)."""

    def __init__(self) -> None:
        self.iterates: list[Weights] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.iterates.append(trainable(model))


class EvaluationRecorder(TrainerCallback):
    """At every evaluation: the step, the metrics and the trainable weights the model held."""

    def __init__(self) -> None:
        self.evaluations: list[tuple[int, dict[str, float], Weights]] = []

    def on_evaluate(self, args, state, control, metrics=None, model=None, **kwargs):
        self.evaluations.append((state.global_step, dict(metrics), trainable(model)))


class SaveAtStep(TrainerCallback):
    """Asks for a checkpoint at ``step`` after ``ParameterAveraging`` has seen the step's flags (a later callback)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
        return control


def test_average_equals_a_hand_computation_over_the_dp_iterates(tmp_path) -> None:
    decay, model = 0.6, tiny_gpt2()
    recorder, averaging = IterateRecorder(), ParameterAveraging(decay, copy_average_at_end=False)
    trainer = make_trainer(model, tmp_path, args=dict(max_steps=5), callbacks=[recorder, averaging])
    trainer.train()
    assert len(recorder.iterates) == trainer.privacy_engine.steps == 5
    assert_weights(model, recorder.iterates[-1])  # copy_average_at_end=False: the last iterate stays
    with averaging.averaged_weights(model):
        assert_weights(model, ema(recorder.iterates, decay), atol=1e-6)
    assert_weights(model, recorder.iterates[-1])  # given back exactly
    with pytest.raises(ValueError, match="has no parameter"):
        with averaging.averaged_weights(tiny_bert_classifier()):
            pass
    with pytest.raises(RuntimeError, match="no average yet"):
        with ParameterAveraging().averaged_weights(model):
            pass


def test_model_holds_the_average_at_the_end_and_save_model_writes_it(tmp_path) -> None:
    decay, model = 0.8, tiny_gpt2()
    recorder = IterateRecorder()
    trainer = make_trainer(model, tmp_path, args=dict(max_steps=4), callbacks=[recorder, ParameterAveraging(decay)])
    trainer.train()
    average = ema(recorder.iterates, decay)
    assert_weights(model, average, atol=1e-6)
    assert any(not torch.equal(average[n], value) for n, value in recorder.iterates[-1].items())
    trainer.save_model(str(tmp_path / "final"))
    assert_weights(transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "final"), average, atol=1e-6)


def test_evaluation_uses_the_average_and_training_continues_from_the_iterate(tmp_path) -> None:
    """Every eval dataset (a dict of two) is evaluated on the average; the training trajectory and epsilon are those
    of the same run without averaging, bit for bit."""
    decay = 0.5
    runs = {}
    for averaged in (False, True):
        model = tiny_bert_classifier()
        recorder, evaluations = IterateRecorder(), EvaluationRecorder()
        averaging = [ParameterAveraging(decay, copy_average_at_end=False)] if averaged else []
        trainer = make_trainer(
            model,
            tmp_path / str(averaged),
            TokenDataset(task="cls"),
            args=dict(max_steps=4, eval_strategy="steps", eval_steps=2),
            eval_dataset={name: TokenDataset(n=8, task="cls", seed=seed) for name, seed in (("a", 1), ("b", 2))},
            callbacks=[recorder, *averaging, evaluations],
        )
        trainer.train()
        runs[averaged] = (trainer, model, recorder.iterates, evaluations.evaluations, averaging)
    plain, averaged = runs[False], runs[True]
    for plain_iterate, iterate in zip(plain[2], averaged[2], strict=True):
        for name, value in iterate.items():
            assert torch.equal(plain_iterate[name], value), name
    assert_weights(averaged[1], plain[2][-1])
    assert averaged[0].get_epsilon() == plain[0].get_epsilon()
    iterates = averaged[2]
    evaluated = [(step, [key for key in metrics if key.endswith("_loss")]) for step, metrics, _ in averaged[3]]
    assert evaluated == [(2, ["eval_a_loss"]), (2, ["eval_b_loss"]), (4, ["eval_a_loss"]), (4, ["eval_b_loss"])]
    for (step, _, held), (_, _, plain_held) in zip(averaged[3], plain[3], strict=True):
        for name, value in ema(iterates[:step], decay).items():
            torch.testing.assert_close(held[name], value, rtol=0, atol=1e-6, msg=name)
        for name, value in iterates[step - 1].items():
            assert torch.equal(plain_held[name], value), name
    trainer, model, averaging = averaged[0], averaged[1], averaged[4][0]
    with averaging.averaged_weights(model):
        final = trainer.evaluate()
    logged = {**averaged[3][-2][1], **averaged[3][-1][1]}
    for key in ("eval_a_loss", "eval_b_loss"):
        assert final[key] == pytest.approx(logged[key], rel=1e-6)
    assert logged["eval_a_loss"] != pytest.approx(plain[3][-2][1]["eval_a_loss"], rel=1e-6)


def plain_trainer(tmp_path, callbacks: list[TrainerCallback], **overrides) -> transformers.Trainer:
    args = training_args(
        tmp_path, max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2, **overrides
    )
    return transformers.Trainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=TokenDataset(),
        eval_dataset=TokenDataset(n=8, seed=1),
        callbacks=callbacks,
    )


@pytest.mark.parametrize(("resume_step", "model_files_hold_average"), [(2, True), (3, False)])
def test_resume_continues_the_average_exactly(tmp_path, resume_step: int, model_files_hold_average: bool) -> None:
    """The plain Trainer (deterministic across a resume): 4 steps equal ``resume_step`` steps + a resume, for the
    model and for the average. Checkpoint 2 is written at an evaluation (its model files hold the average);
    checkpoint 3 is asked for by a callback listed after the averaging one (its model files hold the iterate). The
    resumed run's ``eval_on_start`` evaluates the checkpoint's average."""
    decay = 0.7
    recorder, averaging = IterateRecorder(), ParameterAveraging(decay, copy_average_at_end=False)
    full = plain_trainer(tmp_path, [recorder, averaging, SaveAtStep(3)])
    full.train()
    checkpoint = tmp_path / f"checkpoint-{resume_step}"
    saved = torch.load(checkpoint / AVERAGING_STATE_NAME, weights_only=True)
    assert saved["model_files_hold_average"] is model_files_hold_average
    average, iterate = ema(recorder.iterates[:resume_step], decay), recorder.iterates[resume_step - 1]
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(checkpoint)
    assert_weights(reloaded, average if model_files_hold_average else iterate, atol=1e-6)

    resumed_averaging, evaluations = ParameterAveraging(decay, copy_average_at_end=False), EvaluationRecorder()
    resumed = plain_trainer(tmp_path, [resumed_averaging, evaluations], eval_on_start=True)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    first_step, _, first_evaluated = evaluations.evaluations[0]
    assert first_step == resume_step
    for name, value in average.items():
        torch.testing.assert_close(first_evaluated[name], value, rtol=0, atol=1e-6, msg=name)
    assert_weights(resumed.model, trainable(full.model))
    with averaging.averaged_weights(full.model), resumed_averaging.averaged_weights(resumed.model):
        assert_weights(resumed.model, trainable(full.model))
        assert_weights(full.model, ema(recorder.iterates, decay), atol=1e-6)


def test_dp_resume_continues_the_average_of_the_recorded_iterates(tmp_path) -> None:
    """DPTrainer draws fresh noise after a resume (no noise is replayed), so the resumed iterates differ from the
    first run's; the average continues over the first run's iterates up to the checkpoint and the resumed ones."""
    decay, args = 0.7, dict(max_steps=4, save_strategy="steps", save_steps=2)
    first = IterateRecorder()
    make_trainer(tiny_gpt2(), tmp_path, args=args, callbacks=[first, ParameterAveraging(decay)]).train()
    resumed, model = IterateRecorder(), tiny_gpt2()
    trainer = make_trainer(model, tmp_path, args=args, callbacks=[resumed, ParameterAveraging(decay)])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert len(resumed.iterates) == 2 and trainer.privacy_engine.steps == 4
    assert_weights(model, ema(first.iterates[:2] + resumed.iterates, decay), atol=1e-6)

    (tmp_path / "checkpoint-2" / AVERAGING_STATE_NAME).unlink()
    again = make_trainer(tiny_gpt2(), tmp_path, args=args, callbacks=[ParameterAveraging(decay)])
    with pytest.raises(ValueError, match=f"has no {AVERAGING_STATE_NAME}"):
        again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_a_step_the_optimizer_skips_is_not_averaged(tmp_path) -> None:
    """A run resumed with its budget spent takes one step that DPTrainer skips (no noise, no update): the average
    stays the checkpoint's."""
    budget, privacy = 0.8, PrivacyArguments(noise_multiplier=1.0, accountant="rdp", dp_seed=0)
    args = dict(max_steps=20, save_strategy="steps", save_steps=1)
    model = tiny_gpt2()
    first = make_trainer(
        model, tmp_path, privacy=privacy, args=args, callbacks=[ParameterAveraging(0.5), PrivacyBudget(budget)]
    )
    first.train()
    stopped = first.privacy_engine.steps
    resumed_model, averaging = tiny_gpt2(), ParameterAveraging(0.5)
    resumed = make_trainer(
        resumed_model, tmp_path, privacy=privacy, args=args, callbacks=[averaging, PrivacyBudget(budget)]
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / f"checkpoint-{stopped}"))
    assert resumed.privacy_engine.steps == stopped and resumed.state.global_step == stopped + 1
    assert int(averaging.averaged_model.n_averaged) == stopped
    assert_weights(resumed_model, trainable(model))


@pytest.mark.parametrize("copy_average_at_end", [True, False])
def test_load_best_model_at_end_restores_the_best_checkpoints_average(tmp_path, copy_average_at_end: bool) -> None:
    """The best checkpoint is the one whose average evaluated best; the model ends with that average (or, with
    ``copy_average_at_end=False``, that checkpoint's iterate, its average in ``averaged_weights``)."""
    decay, model = 0.5, tiny_bert_classifier()
    recorder, evaluations = IterateRecorder(), EvaluationRecorder()
    averaging = ParameterAveraging(decay, copy_average_at_end=copy_average_at_end)
    trainer = make_trainer(
        model,
        tmp_path,
        TokenDataset(task="cls"),
        args=dict(
            max_steps=4,
            eval_strategy="steps",
            eval_steps=1,
            save_strategy="steps",
            save_steps=1,
            load_best_model_at_end=True,
            metric_for_best_model="eval_loss",
            learning_rate=0.5,
        ),
        eval_dataset=TokenDataset(n=8, task="cls", seed=1),
        callbacks=[recorder, averaging, evaluations],
    )
    trainer.train()
    best_step, best_metrics, best_weights = min(evaluations.evaluations, key=lambda row: row[1]["eval_loss"])
    assert best_step < 4 and trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best_step}")
    assert_weights(model, best_weights if copy_average_at_end else recorder.iterates[best_step - 1])
    with averaging.averaged_weights(model):
        assert_weights(model, ema(recorder.iterates[:best_step], decay), atol=1e-6)
        assert trainer.evaluate()["eval_loss"] == pytest.approx(best_metrics["eval_loss"], rel=1e-6)


@pytest.mark.parametrize(
    ("decay", "error"),
    [(0, ValueError), (1, ValueError), (-0.1, ValueError), (1.5, ValueError), (math.nan, ValueError)]
    + [("0.9", TypeError), (True, TypeError)],
)
def test_bad_decay_fails_at_construction(decay, error) -> None:
    with pytest.raises(error, match=r"decay must be (a number )?in \(0, 1\)"):
        ParameterAveraging(decay)


def test_lora_averages_only_the_adapters(tmp_path) -> None:
    pytest.importorskip("peft")
    from hf_helpers import lora_llama

    decay, model = 0.5, lora_llama()
    frozen = {name: p for name, p in model.named_parameters() if not p.requires_grad}
    frozen_before = {name: p.detach().clone() for name, p in frozen.items()}
    recorder, averaging = IterateRecorder(), ParameterAveraging(decay)
    make_trainer(model, tmp_path, args=dict(max_steps=3), callbacks=[recorder, averaging]).train()
    adapters = [name for name, p in model.named_parameters() if p.requires_grad]
    assert averaging.parameter_names == adapters
    assert adapters and all("lora_A" in name or "lora_B" in name for name in adapters)
    averaged_size = sum(p.numel() for p in averaging.averaged_model.parameters())
    assert averaged_size == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert averaged_size < sum(p.numel() for p in frozen.values()) / 10  # no copy of the frozen weights
    assert_weights(model, ema(recorder.iterates, decay), atol=1e-6)
    for name, p in model.named_parameters():
        if name in frozen:
            assert p is frozen[name] and torch.equal(p, frozen_before[name]), name


def test_resuming_from_another_runs_checkpoint_is_refused(tmp_path) -> None:
    """The averaging state is read from output_dir/checkpoint-STEP: a resume from a checkpoint of another run (in
    another folder) would pair its weights with this folder's average; the fingerprint of the model files refuses it."""
    plain_trainer(tmp_path / "a", [ParameterAveraging(0.7)]).train()
    other = plain_trainer(tmp_path / "b", [ParameterAveraging(0.7)], learning_rate=0.2)
    other.train()
    resumed = plain_trainer(tmp_path / "a", [ParameterAveraging(0.7)])
    with pytest.raises(ValueError, match="belongs to another checkpoint than the one whose weights the Trainer loaded"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))


class StopAtEvaluation(TrainerCallback):
    """Raises in the first evaluation, while the model holds the average (an interrupted run)."""

    def on_evaluate(self, args, state, control, **kwargs):
        raise KeyboardInterrupt


def test_a_rerun_after_an_interruption_trains_from_the_iterate(tmp_path) -> None:
    recorder, averaging = IterateRecorder(), ParameterAveraging(0.7, copy_average_at_end=False)
    trainer = plain_trainer(tmp_path, [recorder, averaging, StopAtEvaluation()])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    iterate = recorder.iterates[-1]  # step 2's iterate; the model holds the average since the evaluation began
    trainer.callback_handler.remove_callback(StopAtEvaluation)
    begun = {}

    class FirstForward(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            begun.setdefault("weights", trainable(model))

    trainer.add_callback(FirstForward())
    trainer.train()
    for name, value in iterate.items():
        torch.testing.assert_close(begun["weights"][name], value, rtol=0, atol=0, msg=name)


class ScheduleFreeLike(torch.optim.SGD):
    """The interface of schedule-free optimizers: ``eval()`` / ``train()`` swap the model's weights."""

    def eval(self) -> None:
        pass

    def train(self) -> None:
        pass


def test_schedule_free_optimizers_are_refused(tmp_path) -> None:
    model = tiny_gpt2()
    trainer = transformers.Trainer(
        model=model,
        args=training_args(tmp_path),
        train_dataset=TokenDataset(),
        callbacks=[ParameterAveraging(0.7)],
        optimizers=(ScheduleFreeLike(model.parameters(), lr=0.1), None),
    )
    with pytest.raises(ValueError, match="does not support ScheduleFreeLike: a schedule-free optimizer"):
        trainer.train()
