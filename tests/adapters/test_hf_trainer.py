"""DPTrainer (HF Trainer integration): arguments, per-example losses, sampling, accumulation, logging, checkpoints,
rejections, and the model left usable (generate, save_pretrained) after training."""

from __future__ import annotations

import json
import math

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hf_helpers import (  # noqa: E402
    LogRecorder,
    NoiseCounter,
    TokenDataset,
    make_trainer,
    tiny_bert_classifier,
    tiny_gpt2,
    tiny_llama,
    trainable_snapshot,
    training_args,
)
from torch.utils.data import default_collate  # noqa: E402
from transformers import BatchEncoding, HfArgumentParser, TrainingArguments  # noqa: E402

from lightning_dp.clipping import UnsupportedModuleError  # noqa: E402
from lightning_dp.clipping.loss_scaling import FP16_LOSS_SCALE  # noqa: E402
from lightning_dp.data import EmptyBatchCollate  # noqa: E402
from lightning_dp.hf import DPTrainer, PrivacyArguments, PrivacyBudget  # noqa: E402
from lightning_dp.hf.callbacks import PRIVACY_STATE_NAME  # noqa: E402
from lightning_dp.hf.losses import head_kind, sequence_classification_loss, token_cross_entropy  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


# ------------------------------------------------------------------------------------------------ arguments
def test_privacy_arguments_parse_from_cli_json_and_yaml(tmp_path) -> None:
    parser = HfArgumentParser((TrainingArguments, PrivacyArguments))
    _, cli = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--target_epsilon",
            "3",
            "--per_sample_max_grad_norm",
            "0.5",
            "--clipping",
            "ghost",
            "--per_example_reduction",
            "sum",
            "--no_poisson_sampling",
        ]
    )
    assert (cli.target_epsilon, cli.per_sample_max_grad_norm, cli.clipping) == (3.0, 0.5, "ghost")
    assert cli.per_example_reduction == "sum" and cli.poisson_sampling is False
    config = {"noise": "laplace", "noise_params": '{"noise_scale": 2.0}', "per_sample_max_grad_norm": 1.0, "dp_seed": 3}
    (tmp_path / "p.json").write_text(json.dumps(config))
    (from_json,) = HfArgumentParser(PrivacyArguments).parse_json_file(tmp_path / "p.json")
    assert from_json.noise_params == {"noise_scale": 2.0}
    yaml = "noise: laplace\nnoise_params:\n  noise_scale: 2.0\nper_sample_max_grad_norm: 1.0\n"
    (tmp_path / "p.yaml").write_text(yaml)
    (from_yaml,) = HfArgumentParser(PrivacyArguments).parse_yaml_file(tmp_path / "p.yaml")
    assert from_yaml.noise_params == {"noise_scale": 2.0}
    assert from_yaml.make_privacy_engine().mechanism.describe() == from_json.make_privacy_engine().mechanism.describe()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(per_sample_max_grad_norm=-1.0, noise_multiplier=1.0), "max_grad_norm"),
        (dict(target_epsilon=3.0, noise_multiplier=1.0), "exactly one"),
        (dict(), "exactly one"),
        (dict(target_epsilon=-1.0), "epsilon"),
        (dict(target_epsilon=3.0, target_delta=2.0), "delta"),
        (dict(noise_multiplier=1.0, sample_rate=1.5), "sample_rate"),
        (dict(noise_multiplier=1.0, per_example_reduction="median"), "per_example_reduction"),
        (dict(noise="laplace", noise_params="{noise_scale: 2}"), "JSON"),
        (dict(target_epsilon=3.0, clipping="bogus"), "clipping"),
        (dict(target_epsilon=3.0, accountant="bogus"), "accountant"),
        (dict(target_epsilon=3.0, noise="bogus"), "noise"),
    ],
)
def test_privacy_arguments_validate_early(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        PrivacyArguments(**kwargs)


# ------------------------------------------------------------------------------------------ per-example loss
def test_token_losses_per_example_shifted_and_ignoring_minus_100() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7)
    labels = torch.randint(0, 7, (3, 5))
    labels[0, 3:] = -100
    labels[2, 1:] = -100  # only position 0, which a causal LM never predicts: no labelled token
    mean = token_cross_entropy(logits, labels, "mean", shift=True)
    total = token_cross_entropy(logits, labels, "sum", shift=True)
    for i in range(3):
        keep = labels[i, 1:] != -100
        tokens = F.cross_entropy(logits[i, :-1][keep], labels[i, 1:][keep], reduction="none")
        assert torch.allclose(total[i], tokens.sum())
        assert torch.allclose(mean[i], tokens.mean() if keep.any() else torch.tensor(0.0))
    unshifted = token_cross_entropy(logits, labels, "mean", shift=False)
    keep = labels[0] != -100
    assert torch.allclose(unshifted[0], F.cross_entropy(logits[0][keep], labels[0][keep]))


def test_sequence_classification_losses_follow_problem_type() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 3)
    labels = torch.tensor([0, 2, 1, 1])
    ce = sequence_classification_loss(logits, labels, problem_type=None)
    assert torch.allclose(ce, F.cross_entropy(logits, labels, reduction="none"))
    targets = torch.rand(4, 3)
    bce = sequence_classification_loss(logits, targets, problem_type=None)
    assert torch.allclose(bce.mean(), F.binary_cross_entropy_with_logits(logits, targets))
    reg = sequence_classification_loss(logits[:, :1], targets[:, 0], problem_type=None)
    assert torch.allclose(reg, (logits[:, 0] - targets[:, 0]) ** 2)


def test_head_kinds_and_unsupported_head() -> None:
    assert head_kind(tiny_gpt2()) == "causal_lm"
    assert head_kind(tiny_llama()) == "causal_lm"
    assert head_kind(tiny_bert_classifier()) == "sequence_classification"
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_heads=2)
    )
    assert head_kind(t5) == "seq2seq_lm"
    with pytest.raises(ValueError, match="cannot make the loss of GPT2Model per example"):
        head_kind(transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2)))


def test_empty_poisson_batch_of_a_batch_encoding_has_zero_rows() -> None:
    dataset = TokenDataset(n=4)
    collate = EmptyBatchCollate(lambda rows: BatchEncoding(default_collate(rows)), dataset)
    empty = collate([])
    assert all(v.shape[0] == 0 for v in empty.values())


# ------------------------------------------------------------------------------------------- training runs
@pytest.mark.parametrize("model_fn", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_causal_lm_trains_with_noise_once_per_logical_step(model_fn, tmp_path) -> None:
    model = model_fn()
    before = trainable_snapshot(model)
    trainer = make_trainer(model, tmp_path, args=dict(gradient_accumulation_steps=2, max_steps=3))
    counter, recorder = NoiseCounter(trainer), LogRecorder()
    trainer.add_callback(counter)
    trainer.add_callback(recorder)
    trainer.train()
    engine = trainer.privacy_engine
    # q = per_device_train_batch_size * gradient_accumulation_steps * world_size / N
    assert engine.sample_rate == pytest.approx(4 * 2 / 32)
    # noise once per logical step: one draw per trainable tensor per optimizer step, not per micro-batch
    num_tensors = len({id(p) for p in model.parameters() if p.requires_grad})
    assert counter.optimizer_steps == 3 == engine.steps
    assert counter.draws == 3 * num_tensors
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    epsilons = [row["epsilon"] for row in trainer.state.log_history if "loss" in row]
    assert 0 < epsilons[0] < epsilons[1] < epsilons[2] == pytest.approx(engine.epsilon())
    # what loggers (report_to integrations) receive through on_log
    assert [row["epsilon"] for row in recorder.logs if "loss" in row] == epsilons
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    # the model is left as it was: no hooks, generate and save_pretrained work
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)
    model.save_pretrained(tmp_path / "saved")
    reloaded = type(model).from_pretrained(tmp_path / "saved").eval()
    model.eval()
    ids = torch.tensor([[4, 5, 6, 7]])
    assert torch.allclose(model(ids).logits, reloaded(ids).logits)


@pytest.mark.parametrize("clipping", ["mixed", "hutchpp"])
def test_gpt2_trains_with_every_engine_family(clipping, tmp_path) -> None:
    """An exact engine with book-keeping, and a randomized one (accounted by rc) through PrivacyArguments."""
    model = tiny_gpt2()
    before = trainable_snapshot(model)
    k = 16 if clipping == "hutchpp" else None
    privacy = PrivacyArguments(noise_multiplier=1.0, clipping=clipping, projection_dim=k, dp_seed=0)
    trainer = make_trainer(model, tmp_path, privacy=privacy, args=dict(max_steps=2))
    trainer.train()
    engine = trainer.privacy_engine
    assert engine.accountant.name == ("rc" if clipping == "hutchpp" else "pld")
    assert engine.steps == 2 and math.isfinite(engine.epsilon())
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_bert_classifier_trains_with_ghost_clipping_and_calibrated_epsilon(tmp_path) -> None:
    model = tiny_bert_classifier()
    before = trainable_snapshot(model)
    privacy = PrivacyArguments(target_epsilon=2.0, target_delta=1e-3, clipping="ghost", accountant="rdp", dp_seed=1)
    trainer = make_trainer(
        model,
        tmp_path,
        TokenDataset(n=48, task="cls"),
        privacy=privacy,
        args=dict(max_steps=-1, num_train_epochs=2, per_device_train_batch_size=8, logging_steps=4),
    )
    trainer.train()
    engine = trainer.privacy_engine
    # planned steps: 2 epochs of ceil(1 / q) = 6 logical steps
    assert engine.steps == trainer.state.global_step == 12
    assert engine.mechanism.noise_multiplier > 0
    assert 0.9 * 2.0 < engine.epsilon() <= 2.0 + 1e-6
    assert trainer.state.log_history[-1]["epsilon"] == pytest.approx(engine.epsilon())
    assert trainer.get_epsilon() == engine.accountant.get_epsilon(1e-3)  # the call users make (Opacus's name)
    assert trainer.get_epsilon(1e-5) == engine.accountant.get_epsilon(1e-5) > trainer.get_epsilon()
    assert trainer.privacy_summary() == engine.summary() and trainer.privacy_summary()["steps"] == 12
    assert all(math.isfinite(row["loss"]) for row in trainer.state.log_history if "loss" in row)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())


class SizeRecordingTrainer(DPTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        self.sizes.append(len(inputs["input_ids"]))
        return super().training_step(model, inputs, num_items_in_batch)


def test_poisson_batches_vary_and_may_be_empty(tmp_path) -> None:
    dataset = TokenDataset(n=24)
    trainer = SizeRecordingTrainer(
        model=tiny_gpt2(),
        args=training_args(
            tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=-1, num_train_epochs=1
        ),
        train_dataset=dataset,
        privacy_args=PrivacyArguments(noise_multiplier=1.0, accountant="rdp", dp_seed=3),
    )
    trainer.sizes = []
    loader = trainer.get_train_dataloader()
    assert trainer.sample_rate == pytest.approx(2 / 24)
    assert len(loader) == math.ceil(24 / 2) * 2  # one epoch = ceil(1/q) logical steps of 2 micro-batches
    trainer.train()
    assert len(trainer.sizes) == 24 and trainer.privacy_engine.steps == 12
    assert 0 in trainer.sizes and len(set(trainer.sizes)) > 1


def test_resume_continues_epsilon_and_checkpoint_has_no_seed(tmp_path) -> None:
    args = dict(max_steps=4, save_strategy="steps", save_steps=2)
    first = make_trainer(tiny_gpt2(), tmp_path, args=args)
    first.train()
    full_epsilon = first.privacy_engine.epsilon()
    state = json.loads((tmp_path / "checkpoint-2" / PRIVACY_STATE_NAME).read_text())
    assert "seed" not in json.dumps(state) and state["accountant"]["ledger"][0][1] == 2

    resumed = make_trainer(tiny_gpt2(), tmp_path, args=args)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.privacy_engine.steps == 4
    assert resumed.privacy_engine.epsilon() == pytest.approx(full_epsilon)
    first_log = next(row for row in resumed.state.log_history if row.get("step") == 3 and "loss" in row)
    assert first_log["epsilon"] > json_epsilon_at(first, 2)

    (tmp_path / "checkpoint-2" / PRIVACY_STATE_NAME).unlink()
    with pytest.raises(ValueError, match="would restart epsilon at 0"):
        make_trainer(tiny_gpt2(), tmp_path, args=args).train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def json_epsilon_at(trainer: DPTrainer, step: int) -> float:
    return next(row["epsilon"] for row in trainer.state.log_history if row.get("step") == step and "loss" in row)


def test_privacy_budget_stops_before_exceeding(tmp_path) -> None:
    budget = 0.8
    model = tiny_gpt2()
    trainer = make_trainer(model, tmp_path, args=dict(max_steps=20), callbacks=[PrivacyBudget(budget)])
    trainer.train()
    engine = trainer.privacy_engine
    assert 0 < engine.steps < 20
    assert (
        engine.epsilon()
        <= budget
        < engine.accountant.copy().compose(engine.step_event()).get_epsilon(engine.target_delta)
    )


# ---------------------------------------------------------------------------------------------- rejections
@pytest.mark.parametrize(
    ("attribute", "value", "message"),
    [
        ("deepspeed", "ds_config.json", "DeepSpeed.*fully_shard"),
        ("fsdp", "full_shard", "FSDP.*fully_shard"),
        ("max_grad_norm", 0.5, "max_grad_norm=0.5"),
        ("torch_compile", True, "torch_compile"),
        ("include_num_input_tokens_seen", "all", "token count without noise"),
        ("include_num_input_tokens_seen", "non_padding", "token count without noise"),
        ("neftune_noise_alpha", 5.0, "NEFTune scales .* padded length"),
    ],
)
def test_unsupported_training_arguments_fail_early(attribute, value, message, tmp_path) -> None:
    args = training_args(tmp_path)
    setattr(args, attribute, value)  # set after construction: some need a GPU or DeepSpeed to construct
    with pytest.raises(ValueError, match=message):
        DPTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(), privacy_args=PrivacyArguments(1.0, 3.0))


@pytest.mark.parametrize(
    ("attribute", "value", "message"),
    [
        ("include_num_input_tokens_seen", "all", "token count without noise"),
        # the Trainer counts unless the value is the string "no"; only construction turns a bool into a string
        ("include_num_input_tokens_seen", True, "token count without noise"),
        ("include_num_input_tokens_seen", False, "token count without noise"),
        ("include_num_input_tokens_seen", None, "token count without noise"),
        ("neftune_noise_alpha", 5.0, "NEFTune"),
        ("torch_compile", True, "torch_compile"),
        ("max_grad_norm", 0.5, "max_grad_norm=0.5"),
    ],
)
def test_training_arguments_changed_after_construction_are_refused_at_train(
    attribute, value, message, tmp_path
) -> None:
    """``trainer.args`` can be changed between construction and ``train()``: the arguments are checked again there,
    before any step (an ``include_num_input_tokens_seen`` set then was logged and saved without noise)."""
    trainer = make_trainer(tiny_gpt2(), tmp_path)
    setattr(trainer.args, attribute, value)
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert trainer.state.global_step == 0


def test_neftune_set_on_the_trainer_after_construction_is_refused_at_train(tmp_path) -> None:
    """``Trainer.__init__`` copies ``args.neftune_noise_alpha`` into the trainer, and ``train()`` reads that copy
    (found in review)."""
    trainer = make_trainer(tiny_gpt2(), tmp_path)
    trainer.neftune_noise_alpha = 5.0
    with pytest.raises(ValueError, match="NEFTune"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_total_flos_counts_no_sampled_token(tmp_path) -> None:
    """The Trainer's ``total_flos`` (``6 x`` tokens ``x`` parameters per micro-batch) counted the sampled examples'
    tokens, logged and saved in every checkpoint's ``trainer_state.json`` without noise (found in review)."""
    trainer = make_trainer(tiny_gpt2(), tmp_path, args={"save_strategy": "steps", "save_steps": 3})
    trainer.train()
    saved = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())
    assert trainer.state.total_flos == saved["total_flos"] == 0
    assert all(entry.get("total_flos", 0) == 0 for entry in trainer.state.log_history)


def test_the_trainers_hyperparameter_search_is_refused(tmp_path) -> None:
    privacy, data = PrivacyArguments(noise_multiplier=1.0), TokenDataset()
    trainer = DPTrainer(model=tiny_gpt2(), args=training_args(tmp_path), train_dataset=data, privacy_args=privacy)
    with pytest.raises(ValueError, match="hyperparameter_search .* lightning_dp.tuning.private_search"):
        trainer.hyperparameter_search(n_trials=2)


@pytest.mark.parametrize(
    ("flag", "message"), [("is_fsdp_enabled", "FSDP plugin"), ("is_deepspeed_enabled", "DeepSpeed")]
)
def test_sharding_plugins_from_accelerates_config_fail_early(flag, message, tmp_path, monkeypatch) -> None:
    """accelerate's DeepSpeed plugin, or an FSDP plugin set up outside DPTrainer (which takes the launcher's FSDP2
    settings over itself: tests/adapters/test_hf_accelerate_fsdp.py), is refused, naming fully_shard."""
    create = transformers.Trainer.create_accelerator_and_postprocess

    def with_plugin(self):
        create(self)
        setattr(self, flag, True)

    monkeypatch.setattr(transformers.Trainer, "create_accelerator_and_postprocess", with_plugin)
    with pytest.raises(ValueError, match=f"{message}.*fully_shard"):
        make_trainer(tiny_gpt2(), tmp_path)


@pytest.mark.parametrize(
    "attribute",
    [
        "_is_distributed_loading_by_transformers",  # what from_pretrained(distributed_config=...) sets where named
        "_device_mesh",  # what every release that shards at load time sets (4.x tp_plan, 5.17 distributed_config)
    ],
)
def test_a_model_sharded_by_from_pretrained_fails_early(attribute, tmp_path) -> None:
    """The model itself tells, through a PEFT wrapper too (the Trainer's attribute of that name exists only in the
    releases that name it)."""
    model = tiny_gpt2()
    setattr(model, attribute, True if attribute.startswith("_is") else object())
    with pytest.raises(ValueError, match="distributed_config.*fully_shard"):
        make_trainer(model, tmp_path)
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["c_attn"]))
    with pytest.raises(ValueError, match="distributed_config.*fully_shard"):
        make_trainer(wrapped, tmp_path)


def test_default_trainer_clipping_is_switched_off_with_a_log_line(tmp_path, caplog) -> None:
    trainer = make_trainer(tiny_gpt2(), tmp_path, args=dict(max_grad_norm=1.0))
    assert trainer.args.max_grad_norm == 0.0
    assert "switched off" in caplog.text


def test_unsupported_models_and_loss_fail_early(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot make the loss of GPT2Model"):
        make_trainer(transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2)), tmp_path)
    qa = transformers.BertForQuestionAnswering(tiny_bert_classifier().config)
    with pytest.raises(ValueError, match="compute_per_example_loss"):
        make_trainer(qa, tmp_path)
    with_batchnorm = tiny_bert_classifier()
    with_batchnorm.bert.extra = torch.nn.BatchNorm1d(4)
    with pytest.raises(UnsupportedModuleError, match="BatchNorm"):
        make_trainer(with_batchnorm, tmp_path)
    with pytest.raises(ValueError, match="compute_loss_func"):
        make_trainer(tiny_gpt2(), tmp_path, compute_loss_func=lambda outputs, labels, num_items_in_batch: 0)


def tiny_t5() -> transformers.T5ForConditionalGeneration:
    """Tiny T5 with its T5LayerNorm and relative attention bias frozen (the clipper covers neither: the bias embedding
    is looked up with ``[T, T]`` position buckets, not per example); frozen, they need no hook."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=50, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_heads=2, decoder_start_token_id=0, pad_token_id=0
    )
    model = transformers.T5ForConditionalGeneration(config)
    for name, param in model.named_parameters():
        param.requires_grad_("layer_norm" not in name and "relative_attention_bias" not in name)
    return model


def test_seq2seq_per_example_losses_sum_to_the_model_loss_and_train(tmp_path) -> None:
    model = tiny_t5()
    privacy = PrivacyArguments(noise_multiplier=1.0, accountant="rdp", per_example_reduction="sum")
    trainer = make_trainer(model, tmp_path, TokenDataset(n=16), privacy=privacy, args=dict(max_steps=2))
    batch = default_collate([trainer.train_dataset[i] for i in range(4)])
    model.eval()
    per_example = trainer.compute_per_example_loss(model, batch)
    labelled = (batch["labels"] != -100).sum()
    # unshifted (the decoder inputs are the shifted labels): the batch loss is the token mean
    assert torch.allclose(per_example.sum() / labelled, model(**batch).loss)
    before = trainable_snapshot(model)
    trainer.train()
    assert trainer.privacy_engine.steps == 2
    for name, param in model.named_parameters():
        assert torch.equal(before[name], param) == (not param.requires_grad), name


def test_one_noiseless_full_batch_step_equals_the_plain_trainer(tmp_path) -> None:
    """With q = 1, a clipping bound no gradient reaches and negligible noise, a DP step is the Trainer's step (SGD:
    Adam's first step is lr * sign(g), which even 1e-6 noise flips on coordinates whose gradient is 0)."""
    dataset = TokenDataset(n=8, task="cls")
    models = []
    for trainer_cls in (transformers.Trainer, DPTrainer):
        model = tiny_bert_classifier()
        model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.0
        model = type(model)(model.config)
        model.load_state_dict(tiny_bert_classifier().state_dict())
        extra = {}
        if trainer_cls is DPTrainer:
            extra["privacy_args"] = PrivacyArguments(
                noise_multiplier=1e-12, per_sample_max_grad_norm=1e6, accountant="rdp"
            )
        trainer = trainer_cls(
            model=model,
            args=training_args(tmp_path, per_device_train_batch_size=8, max_steps=1, learning_rate=0.1, optim="sgd"),
            train_dataset=dataset,
            **extra,
        )
        trainer.train()
        models.append(model)
    plain, private = (dict(m.named_parameters()) for m in models)
    for name, param in plain.items():
        torch.testing.assert_close(private[name], param, rtol=1e-4, atol=1e-6, msg=name)


def test_an_optimizer_over_tensors_outside_the_model_is_refused(tmp_path) -> None:
    """A tensor the optimizer updates but the clipping hooks never see would be noised, never clipped (also what a
    model sharded at construction leaves an optimizer built before it holding)."""
    model = tiny_gpt2()
    outside = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([*model.parameters(), outside], lr=0.1)
    trainer = make_trainer(model, tmp_path, optimizers=(optimizer, None))
    with pytest.raises(ValueError, match=r"updates 1 tensor\(s\) that are not parameters of the model"):
        trainer.train()
    accepted = make_trainer(tiny_gpt2(), tmp_path, args=dict(max_steps=1))
    accepted.optimizer = torch.optim.SGD(accepted.model.parameters(), lr=0.1)  # the model's own: trains
    accepted.train()
    assert accepted.privacy_engine.steps == 1


def test_stale_privacy_state_is_removed_before_a_checkpoint_folder_is_rewritten(tmp_path) -> None:
    """The Trainer rewrites ``checkpoint-STEP`` in place (a resumed run reaching the same step): the old privacy state
    goes first, so a kill mid-write cannot leave new files under an old marker that resuming would trust."""
    from transformers import TrainerControl, TrainerState

    from lightning_dp.hf.callbacks import PrivacyStateCallback
    from lightning_dp.runtime.checkpoints import last_complete_checkpoint

    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    (folder / PRIVACY_STATE_NAME).write_text("{}")
    state = TrainerState(global_step=4, is_world_process_zero=True)
    args = training_args(tmp_path)
    callback = PrivacyStateCallback(PrivacyArguments(noise_multiplier=1.0).make_privacy_engine())
    callback.on_step_end(args, state, TrainerControl(should_save=False))
    assert last_complete_checkpoint(tmp_path, PRIVACY_STATE_NAME) == str(folder)
    callback.on_step_end(args, state, TrainerControl(should_save=True))
    assert last_complete_checkpoint(tmp_path, PRIVACY_STATE_NAME) is None


def test_disable_dp_trains_exactly_as_the_plain_trainer_and_reports_infinite_epsilon(tmp_path, caplog) -> None:
    """``PrivacyArguments(disable_dp=True)``, the dp-transformers switch: the same script trains as the plain
    ``Trainer`` would (same parameters, bit for bit, TrainingArguments' own batch clipping included), logs
    ``epsilon = inf`` where DP runs log epsilon, and says so once."""
    args = dict(max_steps=3, max_grad_norm=1.0)
    plain_model = tiny_gpt2()
    transformers.Trainer(
        model=plain_model, args=training_args(tmp_path / "plain", **args), train_dataset=TokenDataset()
    ).train()
    privacy = PrivacyArguments(target_epsilon=3.0, disable_dp=True)
    model = tiny_gpt2()
    trainer = make_trainer(model, tmp_path / "off", privacy=privacy, args=args)
    with caplog.at_level("WARNING", logger="lightning_dp"):
        trainer.train()
    for (name, p), q in zip(model.named_parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert [row["epsilon"] for row in trainer.state.log_history if "loss" in row] == [math.inf] * 3
    assert trainer.get_epsilon() == math.inf and trainer.args.max_grad_norm == 1.0
    assert sum("WITHOUT differential privacy" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="disable_dp"):
        trainer.privacy_summary()
    parsed = transformers.HfArgumentParser(PrivacyArguments).parse_args_into_dataclasses(
        ["--target_epsilon", "3", "--disable_dp", "true"]
    )[0]
    assert parsed.disable_dp is True


def test_fp16_from_the_accelerate_config_sets_the_clippers_loss_scale(tmp_path, monkeypatch) -> None:
    """``mixed_precision: fp16`` in an accelerate config reaches the Trainer through the environment, not fp16=True:
    it is accepted (docs/privacy.md, "Mixed precision") and, like fp16=True, runs the clipper's backward at the fixed
    float16 loss scale (on CPU accelerate sets up neither autocast nor a GradScaler for it)."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    args = training_args(tmp_path, max_steps=1)
    assert not args.fp16 and args.mixed_precision == "fp16"
    privacy = PrivacyArguments(1.0, 3.0)
    trainer = DPTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(), privacy_args=privacy)
    clippers = []
    start_run = trainer.privacy_engine.start_run

    def recording(*a, **k):
        start_run(*a, **k)
        clippers.append(trainer.privacy_engine.state.clipper)

    trainer.privacy_engine.start_run = recording
    trainer.train()
    assert clippers and clippers[0].loss_scale == FP16_LOSS_SCALE
