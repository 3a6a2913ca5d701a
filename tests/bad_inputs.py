"""Registry of rejected inputs: each case builds one bad configuration and names the message it must
fail with. ``tests/config/test_bad_inputs.py`` asserts every case; ``scripts/validation_table.py`` runs the same cases
and writes ``docs/validation.md`` from the messages actually raised, so the table cannot drift from the code.

Surfaces: ``DPStrategy``, ``DPModelParallelStrategy`` and ``DPDDPStrategy`` arguments (constructor), a Lightning
``fit`` with ``DPStrategy`` (setup and first step), the HF integration (``PrivacyArguments``, ``DPTrainer``), the
``lightning-dp`` command line, YAML configs of ``lightning-dp fit``, the HF recipes' YAML and flags, the private
hyper-parameter search (``private_search`` and its plan), and the extension registries (``register_mechanism``,
``register_engine``, ``register_layer``: a registration that would replace an entry).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class BadInput:
    """One rejected input.

    Attributes:
        surface: where the user gives it (``DPStrategy``, ``Lightning fit``, ``HF PrivacyArguments``, ...).
        value: the bad input as the user writes it.
        run: builds (and for fit-time cases, starts) the configuration; must raise.
        match: regular expression the message must match.
    """

    surface: str
    value: str
    run: Callable[[], Any]
    match: str


class CommandLineError(Exception):
    """A command (``lightning-dp``, a recipe script) that exited with a non-zero status; the message is its error
    line, ``program`` the command."""

    def __init__(self, message: str, program: str) -> None:
        super().__init__(message)
        self.program = program


def failure(case: BadInput) -> tuple[str, str]:
    """Run ``case`` and return ``(message, where)``: the error's message and the ``lightning_dp`` function that raised
    it (``file:function``; the CLI for command-line cases).

    Raises:
        AssertionError: the case did not fail.
    """
    try:
        case.run()
    except CommandLineError as error:
        return str(error).strip(), f"{error.program} (exit status 2)"
    except Exception as error:  # noqa: BLE001 - every rejection is reported, whatever its type
        frames = [f for f in traceback.extract_tb(error.__traceback__) if "/lightning_dp/" in f.filename]
        where = "(outside lightning_dp)"
        if frames:
            frame = frames[-1]
            where = f"{Path(frame.filename).relative_to(ROOT).as_posix()}:{frame.name}"
        return f"{type(error).__name__}: {error}", where
    raise AssertionError(f"{case.surface} {case.value}: no error raised")


# ------------------------------------------------------------------------------------------------- builders
def _construct(class_name: str, **kwargs: Any) -> Callable[[], Any]:
    """Builds ``lightning_dp.<class_name>(**kwargs)`` (a strategy's constructor)."""

    def run() -> Any:
        import lightning_dp

        return getattr(lightning_dp, class_name)(**kwargs)

    return run


def _strategy(**kwargs: Any) -> Callable[[], Any]:
    return _construct("DPStrategy", **kwargs)


def _fit(module_factory: Callable[[], Any], strategy_kwargs: dict[str, Any] | None = None, **trainer_kwargs: Any):
    def run() -> None:
        from lightning_dp import DPStrategy
        from tests.helpers import make_trainer

        kwargs = {"noise_multiplier": 1.0, **(strategy_kwargs or {})}
        if not kwargs.get("secure_mode"):  # seeded, so the rendered messages are the same every time
            kwargs.setdefault("seed", 0)
        trainer_kwargs.setdefault("max_steps", 2)
        torch.manual_seed(0)
        make_trainer(DPStrategy(**kwargs), **trainer_kwargs).fit(module_factory())

    return run


def _fit_with_callback(name: str) -> Callable[[], None]:
    """:func:`_fit` of the tiny regressor with Lightning's callback ``name`` (built when it runs)."""

    def run() -> None:
        from lightning.pytorch import callbacks

        _fit(_tiny(), callbacks=[getattr(callbacks, name)()])()

    return run


def _body(factory: Callable[[], nn.Module]) -> Callable[[], Any]:
    def make() -> Any:
        from tests.helpers import ClassifierWith

        return ClassifierWith(factory())

    return make


def _tiny(**kwargs: Any) -> Callable[[], Any]:
    def make() -> Any:
        from tests.helpers import TinyRegressor

        return TinyRegressor(**kwargs)

    return make


def _reordered_each_epoch() -> Any:
    """A TinyRegressor whose every training loader is a new, reordered ``Subset`` of its data."""
    from torch.utils.data import DataLoader, Subset

    from tests.helpers import TinyRegressor

    class Reordered(TinyRegressor):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(Subset(self.data, torch.randperm(len(self.data)).tolist()), batch_size=4)

    return Reordered(batch_size=4)


class _Centered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h - h.mean(0))


class _NoisyScale(nn.Module):
    """``x * scale + noise`` with its own trainable ``nn.Parameter`` and noise filled in place: the exact fallback
    cannot rerun that random forward per sample (it replays dropout and ``torch.rand``-like draws only)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + torch.empty_like(x).uniform_()


class _RunningMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 1)
        self.register_buffer("running", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.running.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.lin(x)


def _manual_optimization() -> Any:
    from tests.helpers import TinyRegressor

    module = TinyRegressor()
    module.automatic_optimization = False
    return module


def _privacy_arguments(**kwargs: Any) -> Callable[[], Any]:
    def run() -> Any:
        from lightning_dp.hf import PrivacyArguments

        return PrivacyArguments(**kwargs)

    return run


def _hf_trainer(
    attribute: str | None = None, value: Any = None, model: Callable[[], nn.Module] | None = None, **more: Any
):
    def run() -> Any:
        from lightning_dp.hf import DPTrainer, PrivacyArguments
        from tests.hf_helpers import TokenDataset, tiny_gpt2, training_args

        with tempfile.TemporaryDirectory() as tmp:
            args = training_args(tmp)
            for name, setting in {**({attribute: value} if attribute is not None else {}), **more}.items():
                setattr(args, name, setting)  # after construction: some need a GPU to construct
            return DPTrainer(
                model=(model or tiny_gpt2)(),
                args=args,
                train_dataset=TokenDataset(),
                privacy_args=PrivacyArguments(per_sample_max_grad_norm=1.0, target_epsilon=3.0),
            )

    return run


def _gpt2_with(extra: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from tests.hf_helpers import tiny_gpt2

        model = tiny_gpt2()
        model.transformer.extra = extra()
        return model

    return make


def _command(program: str, main: Callable[[], int]) -> None:
    """Run a command's ``main``; raise :class:`CommandLineError` with its last error line if it fails."""
    stderr = io.StringIO()
    code: Any = 0
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main()
        except SystemExit as exit_:
            code = exit_.code
    if code:
        lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line] or lines[:1]
        raise CommandLineError(errors[-1], program)


def _cli(*argv: str) -> Callable[[], None]:
    def run() -> None:
        from lightning_dp.cli.main import main

        _command("lightning-dp", lambda: main(list(argv)))

    return run


@contextlib.contextmanager
def _in_temporary_folder() -> Iterator[Path]:
    """Run in a new temporary folder, so that a config file there is named ``bad.yaml`` in the message."""
    here = Path.cwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            yield Path(tmp)
        finally:
            os.chdir(here)


GAUSS = ("--noise", "gaussian", "--sample-rate", "0.01", "--steps", "1000", "--delta", "1e-5")


def _yaml(edit: Callable[[dict[str, Any]], None], *flags: str) -> Callable[[], None]:
    """``lightning-dp fit --config bad.yaml FLAGS`` where bad.yaml is configs/digits_cnn.yaml changed by ``edit``
    (with 1 step)."""

    def run() -> None:
        config = yaml.safe_load((ROOT / "configs" / "digits_cnn.yaml").read_text())
        config["trainer"].update(max_steps=1, max_epochs=1, enable_progress_bar=False, enable_model_summary=False)
        config["trainer"]["callbacks"] = []
        edit(config)
        with _in_temporary_folder() as tmp:
            Path("bad.yaml").write_text(yaml.safe_dump(config))
            _cli("fit", "--config", "bad.yaml", "--trainer.default_root_dir", str(tmp), *flags)()

    return run


def _recipe(changes: dict[str, Any], *flags: str) -> Callable[[], None]:
    """``python recipes/glue.py --config bad.yaml FLAGS`` where bad.yaml is configs/glue_offline.yaml with
    ``changes``."""

    def run() -> None:
        from lightning_dp.recipes import glue
        from lightning_dp.recipes.run import script_main

        config = {**yaml.safe_load((ROOT / "configs" / "glue_offline.yaml").read_text()), **changes}
        argv = ["--config", "bad.yaml", *flags]
        with _in_temporary_folder(), contextlib.ExitStack() as restore:
            Path("bad.yaml").write_text(yaml.safe_dump(config))
            restore.callback(setattr, sys, "argv", sys.argv)
            sys.argv = ["recipes/glue.py", *argv]
            _command("recipes/glue.py", lambda: script_main(lambda: glue.main(argv)))

    return run


def _strategy_args(**kwargs: Any) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        config["trainer"]["strategy"]["init_args"].update(kwargs)

    return edit


def _trainer_args(**kwargs: Any) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        config["trainer"].update(kwargs)

    return edit


def _refused_registration(registry: Callable[[], Any], register: Callable[[], Any]) -> Callable[[], None]:
    """``register()``, a registration that must be refused, checking that it left ``registry()`` exactly as it was
    (same keys, same values, same order). One that changed it is undone, and the case fails with an
    ``AssertionError`` (outside ``lightning_dp``), whether or not it raised."""

    def run() -> None:
        entries = registry()
        saved = list(entries.items())
        try:
            register()
        finally:
            if [(key, id(value)) for key, value in entries.items()] != [(key, id(value)) for key, value in saved]:
                dict.clear(entries)  # the registry's own writing methods refuse: restore through dict's
                dict.update(entries, saved)
                raise AssertionError(f"the refused registration changed the {entries.kind} registry")

    return run


def _mechanisms() -> Any:
    from lightning_dp.mechanisms import MECHANISMS

    return MECHANISMS


def _register_mechanism_named_gaussian() -> None:
    from lightning_dp.mechanisms import NoiseMechanism, register_mechanism

    class PluginGaussian(NoiseMechanism):
        name = "gaussian"

    register_mechanism(PluginGaussian)


def _engines() -> Any:
    from lightning_dp.clipping import ENGINES

    return ENGINES


def _register_engine_named_ghost() -> None:
    from lightning_dp.clipping import ClippingEngine, register_engine

    class PluginGhost(ClippingEngine):
        name = "ghost"

    register_engine(PluginGhost)


def _layer_types() -> Any:
    import lightning_dp.clipping  # noqa: F401 - registers the built-in layer families
    from lightning_dp.clipping.layers.registry import _BY_TYPE

    return _BY_TYPE


def _register_layer_for_linear() -> None:
    from lightning_dp.clipping import register_layer

    def plugin_linear_terms(layer: nn.Module, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Any]:
        return {}

    register_layer(nn.Linear)(plugin_linear_terms)


def _repetitions(mean: float, shape: float) -> Any:
    from lightning_dp.tuning import RepetitionDistribution

    return RepetitionDistribution(mean, shape)


def _search_plan(shape: float) -> Callable[[], Any]:
    def run() -> Any:
        from lightning_dp.tuning import SearchPlan

        return SearchPlan(1.0, 0.01, 1000, 1e-5, _repetitions(3.0, shape))

    return run


def _private_search(space: dict[str, list[Any]]) -> Callable[[], Any]:
    def run() -> Any:
        from lightning_dp.tuning import SearchPlan, private_search

        plan = SearchPlan(1.0, 0.01, 1000, 1e-5, _repetitions(3.0, 1.0))
        with tempfile.TemporaryDirectory() as tmp:
            return private_search(lambda candidate: (0.0, None), space, plan, tmp)

    return run


def _hf_skipping_resume(**options: Any) -> Callable[[], Any]:
    """``train(resume_from_checkpoint=...)`` of a run with ``options`` (banded noise, ``exact_resume``) without
    ``ignore_data_skip``: refused before the checkpoint is read (so none is needed)."""
    return functools.partial(_hf_resume, options)


def _hf_resume(options: dict[str, Any]) -> Any:
    from lightning_dp.hf import DPTrainer, PrivacyArguments
    from tests.hf_helpers import TokenDataset, tiny_gpt2, training_args

    with tempfile.TemporaryDirectory() as tmp:
        privacy = PrivacyArguments(noise_multiplier=1.0, dp_seed=0, **options)
        trainer = DPTrainer(
            model=tiny_gpt2(), args=training_args(tmp), train_dataset=TokenDataset(), privacy_args=privacy
        )
        return trainer.train(resume_from_checkpoint=str(Path(tmp) / "checkpoint-2"))


def _hf_pushed_secret() -> Any:
    """``exact_resume`` with checkpoint folders pushed to the Hub: refused before the Trainer sets up the repository
    (so no network is needed)."""
    from lightning_dp.hf import DPTrainer, PrivacyArguments
    from tests.hf_helpers import TokenDataset, tiny_gpt2, training_args

    with tempfile.TemporaryDirectory() as tmp:
        args = training_args(tmp)
        args.push_to_hub, args.hub_strategy = True, "checkpoint"
        privacy = PrivacyArguments(noise_multiplier=1.0, exact_resume=True)
        return DPTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(), privacy_args=privacy)


# ---------------------------------------------------------------------------------------------------- cases
CASES: list[BadInput] = [
    # DPStrategy arguments, rejected at construction
    BadInput("DPStrategy", "max_grad_norm=0", _strategy(max_grad_norm=0.0, noise_multiplier=1.0), "max_grad_norm"),
    BadInput(
        "DPStrategy", "max_grad_norm=inf", _strategy(max_grad_norm=float("inf"), noise_multiplier=1.0), "max_grad_norm"
    ),
    BadInput(
        "DPStrategy",
        "target_epsilon=-1",
        _strategy(target_epsilon=-1.0),
        "^ValueError: target_epsilon must be positive, got -1.0; a typical budget is 1 to 10$",
    ),
    BadInput(
        "DPStrategy",
        "target_delta=1.5",
        _strategy(target_epsilon=1.0, target_delta=1.5),
        "^ValueError: target_delta must lie in",
    ),
    BadInput(
        "DPStrategy",
        "target_epsilon=3 with noise_multiplier=1",
        _strategy(target_epsilon=3.0, noise_multiplier=1.0),
        "exactly one",
    ),
    BadInput("DPStrategy", "neither target_epsilon nor noise", _strategy(), "exactly one"),
    BadInput("DPStrategy", "noise='gauss'", _strategy(target_epsilon=1.0, noise="gauss"), "did you mean .gaussian"),
    BadInput(
        "DPStrategy", "accountant='moments'", _strategy(target_epsilon=1.0, accountant="moments"), "Unknown accountant"
    ),
    BadInput(
        "DPStrategy",
        "clipping='per-layer'",
        _strategy(target_epsilon=1.0, clipping="per-layer"),
        "clipping must be one of .*clipping_groups='per_layer'",
    ),
    BadInput(
        "DPStrategy",
        "max_grad_norm=[0.5, 0.5] without clipping_groups",
        _strategy(target_epsilon=1.0, max_grad_norm=[0.5, 0.5]),
        "clipping_groups is not set",
    ),
    BadInput(
        "DPStrategy",
        "clipping_groups='per_layer', noise='laplace'",
        _strategy(noise="laplace", noise_params={"noise_scale": 1.0}, clipping_groups="per_layer"),
        "clipping_groups needs an l2 mechanism",
    ),
    BadInput(
        "DPStrategy",
        "clipping_fn='auto'",
        _strategy(target_epsilon=1.0, clipping_fn="auto"),
        "clipping_fn must be one of",
    ),
    BadInput(
        "DPStrategy",
        "automatic_clipping_gamma=-0.01",
        _strategy(target_epsilon=1.0, clipping_fn="automatic", automatic_clipping_gamma=-0.01),
        "automatic_clipping_gamma must be a finite number >= 0",
    ),
    BadInput(
        "DPStrategy",
        "clipping_fn='automatic', clipping='hutch'",
        _strategy(target_epsilon=1.0, clipping_fn="automatic", clipping="hutch"),
        "clipping_fn='automatic' needs an exact clipping engine",
    ),
    BadInput(
        "DPStrategy",
        "clipping_fn='automatic', target_unclipped_quantile=0.5",
        _strategy(target_epsilon=1.0, clipping_fn="automatic", target_unclipped_quantile=0.5),
        "remove target_unclipped_quantile or use clipping_fn='abadi'",
    ),
    BadInput("DPStrategy", "noise_multiplier=-1", _strategy(noise_multiplier=-1.0), "noise_multiplier must be >= 0"),
    BadInput(
        "DPStrategy",
        "noise='laplace', noise_multiplier=1",
        _strategy(noise="laplace", noise_multiplier=1.0),
        "noise_params",
    ),
    BadInput(
        "DPStrategy",
        "noise='lap2', noise_params={'noise_scale': -2}",
        _strategy(noise="lap2", noise_params={"noise_scale": -2.0}),
        "noise_scale",
    ),
    BadInput(
        "DPStrategy",
        "noise='plrv', gamma_shape=1",
        _strategy(noise="plrv", noise_params={"gamma_shape": 1.0, "gamma_scale": 0.1}),
        "gamma_shape must be > 1",
    ),
    BadInput(
        "DPStrategy",
        "target_unclipped_quantile=1.5",
        _strategy(noise_multiplier=1.0, target_unclipped_quantile=1.5),
        r"target_unclipped_quantile must be in \(0, 1\)",
    ),
    BadInput(
        "DPStrategy",
        "max_clipbound=3 without target_unclipped_quantile",
        _strategy(noise_multiplier=1.0, max_clipbound=3.0),
        "without target_unclipped_quantile",
    ),
    BadInput(
        "DPStrategy",
        "target_unclipped_quantile=0.5, noise='lap2'",
        _strategy(noise="lap2", noise_params={"noise_scale": 1.0}, target_unclipped_quantile=0.5),
        "needs noise='gaussian'",
    ),
    BadInput(
        "DPStrategy",
        "clipping='hutch', noise='laplace'",
        _strategy(clipping="hutch", noise="laplace", noise_params={"noise_scale": 1.0}),
        "randomized-clipping",
    ),
    BadInput("DPStrategy", "sample_rate=1.5", _strategy(noise_multiplier=1.0, sample_rate=1.5), "sample_rate"),
    BadInput("DPStrategy", "sum_check_every=0", _strategy(noise_multiplier=1.0, sum_check_every=0), "sum_check_every"),
    BadInput(
        "DPStrategy", "bookkeeping=True", _strategy(noise_multiplier=1.0, bookkeeping=True), "bookkeeping.*removed"
    ),
    BadInput(
        "DPStrategy",
        "secure_mode=True, seed=0",
        _strategy(noise_multiplier=1.0, seed=0, secure_mode=True),
        "secure_mode.*seed",
    ),
    BadInput(
        "DPStrategy",
        "exact_resume=True, secure_mode=True",
        _strategy(noise_multiplier=1.0, exact_resume=True, secure_mode=True),
        r"exact_resume=True cannot continue this run \(secure_mode=True",
    ),
    BadInput(
        "DPStrategy",
        "exact_resume=True, privacy_unit='user'",
        _strategy(noise_multiplier=1.0, exact_resume=True, privacy_unit="user", user_key="user"),
        r"exact_resume=True cannot continue this run \(privacy_unit='user'",
    ),
    BadInput(
        "DPStrategy",
        "exact_resume=True, poisson_sampling=False",
        _strategy(noise_multiplier=1.0, exact_resume=True, poisson_sampling=False),
        r"exact_resume=True cannot continue this run \(poisson_sampling=False",
    ),
    BadInput(
        "DPStrategy",
        "exact_resume=True, clipping='hutch'",
        _strategy(noise_multiplier=1.0, exact_resume=True, clipping="hutch"),
        r"exact_resume=True cannot continue this run \(clipping='hutch' draws projections per rank",
    ),
    BadInput(
        "DPStrategy",
        "check_batch_independence_every=0",
        _strategy(noise_multiplier=1.0, check_batch_independence_every=0),
        "check_batch_independence_every must be a positive whole number of optimizer steps or None",
    ),
    BadInput(
        "DPStrategy",
        "check_batch_independence_every=10, check_batch_independence=False",
        _strategy(noise_multiplier=1.0, check_batch_independence=False, check_batch_independence_every=10),
        "set check_batch_independence=True",
    ),
    BadInput(
        "DPStrategy",
        "augmentation_multiplicity=0",
        _strategy(noise_multiplier=1.0, augmentation_multiplicity=0),
        "augmentation_multiplicity must be an integer >= 1",
    ),
    # DPModelParallelStrategy (FSDP2-sharded models): what it does not support
    BadInput(
        "DPModelParallelStrategy",
        "tensor_parallel_size=2",
        _construct("DPModelParallelStrategy", noise_multiplier=1.0, tensor_parallel_size=2),
        "over tensor parallelism is not supported",
    ),
    BadInput(
        "DPDDPStrategy",
        "start_method='spawn'",
        _construct("DPDDPStrategy", noise_multiplier=1.0, start_method="spawn"),
        "privacy ledger never reaches this process",
    ),
    # Lightning fit with DPStrategy: setup and first step
    BadInput(
        "Lightning fit",
        "augmentation_multiplicity=2 with a training_step that makes no copies",
        _fit(_tiny(), {"augmentation_multiplicity": 2}),
        r"with augmentation_multiplicity=2 every hooked layer must see the 2 copies of each example",
    ),
    BadInput(
        "Lightning fit",
        "target_unclipped_quantile=0.5 with expected batch 8 (default unclipped_num_std 0.4)",
        _fit(_tiny(), {"target_unclipped_quantile": 0.5}),
        r"unclipped_num_std > noise_multiplier / 2",
    ),
    BadInput(
        "Lightning fit",
        "clipping_groups='per_layer', max_grad_norm=[1, 1, 1] on two layers",
        _fit(_tiny(), {"clipping_groups": "per_layer", "max_grad_norm": [1.0, 1.0, 1.0]}),
        r"makes 2 groups on this model, in order \[0: net.0, 1: net.2\]",
    ),
    BadInput(
        "Lightning fit",
        "clipping_groups=[['net.0.*']] (net.2 in no group)",
        _fit(_tiny(), {"clipping_groups": [["net.0.*"]]}),
        r"matched by no group: 'net.2.weight', 'net.2.bias'",
    ),
    BadInput(
        "Lightning fit",
        "nn.BatchNorm1d in the model",
        _fit(_body(lambda: nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)))),
        "GroupNorm",
    ),
    BadInput(
        "Lightning fit",
        "nn.InstanceNorm1d(track_running_stats=True)",
        _fit(
            _body(
                lambda: nn.Sequential(
                    nn.Linear(6, 4),
                    nn.Unflatten(1, (1, 4)),
                    nn.InstanceNorm1d(1, track_running_stats=True),
                    nn.Flatten(),
                    nn.Linear(4, 1),
                )
            )
        ),
        "track_running_stats",
    ),
    BadInput(
        "Lightning fit",
        "nn.Embedding(max_norm=1.0) in the model",
        _fit(_body(lambda: nn.Sequential(nn.Embedding(10, 6, max_norm=1.0), nn.Linear(6, 1)))),
        "max_norm",
    ),
    BadInput(
        "Lightning fit",
        "a module with its own trainable nn.Parameter and in-place random noise (the fallback cannot rerun it)",
        _fit(_body(lambda: nn.Sequential(nn.Linear(6, 4), _NoisyScale(), nn.Linear(4, 1)))),
        "cannot be rerun per sample",
    ),
    BadInput(
        "Lightning fit",
        "buffer written in forward (running mean)",
        _fit(_body(_RunningMean)),
        "'running' of module 'body'",
    ),
    BadInput("Lightning fit", "h - h.mean(0) in forward", _fit(_body(_Centered)), "batch-independence"),
    BadInput(
        "Lightning fit",
        "training_step returns loss.mean()",
        _fit(_tiny(per_sample=False)),
        r"per-sample loss of shape \[B\]",
    ),
    BadInput(
        "Lightning fit", "Trainer(gradient_clip_val=1.0)", _fit(_tiny(), gradient_clip_val=1.0), "gradient_clip_val"
    ),
    BadInput("Lightning fit", "Trainer(precision='16-true')", _fit(_tiny(), precision="16-true"), "precision"),
    *(
        BadInput("Lightning fit", f"Trainer(callbacks=[{name}()])", _fit_with_callback(name), name)
        for name in ("LearningRateFinder", "BatchSizeFinder")
    ),
    BadInput("Lightning fit", "automatic_optimization=False", _fit(_manual_optimization), "automatic optimization"),
    BadInput("Lightning fit", "Trainer(devices=2) with DPStrategy", _fit(_tiny(), devices=2), "DPDDPStrategy"),
    BadInput(
        "Lightning fit",
        "limit_train_batches=5, accumulate_grad_batches=2",
        _fit(_tiny(batch_size=4), accumulate_grad_batches=2, limit_train_batches=5, max_epochs=1, max_steps=-1),
        "multiple of accumulate_grad_batches",
    ),
    BadInput(
        "Lightning fit",
        "target_epsilon with max_epochs=-1 (unbounded)",
        _fit(_tiny(), {"noise_multiplier": None, "target_epsilon": 1.0}, max_epochs=-1, max_steps=-1),
        "finite number of steps",
    ),
    # HF integration
    BadInput(
        "HF PrivacyArguments",
        "per_sample_max_grad_norm=-1",
        _privacy_arguments(per_sample_max_grad_norm=-1.0, noise_multiplier=1.0),
        "^ValueError: per_sample_max_grad_norm must be a positive finite number, got -1.0; e.g. 1.0",
    ),
    BadInput(
        "HF PrivacyArguments",
        "target_epsilon=0",
        _privacy_arguments(target_epsilon=0.0),
        "^ValueError: target_epsilon must be positive, got 0.0; a typical budget is 1 to 10$",
    ),
    BadInput(
        "HF PrivacyArguments",
        "noise_params='{noise_scale: 2}' (not JSON)",
        _privacy_arguments(noise="laplace", noise_params="{noise_scale: 2}"),
        "JSON",
    ),
    BadInput(
        "HF PrivacyArguments",
        "per_example_reduction='median'",
        _privacy_arguments(noise_multiplier=1.0, per_example_reduction="median"),
        "per_example_reduction",
    ),
    BadInput(
        "HF PrivacyArguments",
        "sample_rate=1.5",
        _privacy_arguments(noise_multiplier=1.0, sample_rate=1.5),
        "sample_rate",
    ),
    BadInput(
        "HF PrivacyArguments",
        "secure_mode=True, dp_seed=1",
        _privacy_arguments(noise_multiplier=1.0, dp_seed=1, secure_mode=True),
        "secure_mode=True .* so dp_seed=1 cannot apply",
    ),
    BadInput(
        "HF PrivacyArguments",
        "check_batch_independence_every=-1",
        _privacy_arguments(noise_multiplier=1.0, check_batch_independence_every=-1),
        "check_batch_independence_every must be a positive whole number",
    ),
    BadInput(
        "HF DPTrainer",
        "TrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs={'use_reentrant': True})",
        _hf_trainer("gradient_checkpointing_kwargs", {"use_reentrant": True}, gradient_checkpointing=True),
        "use_reentrant=False",
    ),
    BadInput(
        "HF DPTrainer", "TrainingArguments(max_grad_norm=0.5)", _hf_trainer("max_grad_norm", 0.5), "max_grad_norm=0.5"
    ),
    BadInput(
        "HF DPTrainer", "TrainingArguments(torch_compile=True)", _hf_trainer("torch_compile", True), "torch_compile"
    ),
    BadInput(
        "HF DPTrainer",
        "TrainingArguments(include_num_input_tokens_seen='all')",
        _hf_trainer("include_num_input_tokens_seen", "all"),
        "include_num_input_tokens_seen",
    ),
    BadInput(
        "HF DPTrainer", "TrainingArguments(neftune_noise_alpha=5.0)", _hf_trainer("neftune_noise_alpha", 5.0), "NEFTune"
    ),
    BadInput(
        "HF DPTrainer",
        "BatchNorm1d added to a GPT-2",
        _hf_trainer(model=_gpt2_with(lambda: nn.BatchNorm1d(4))),
        "BatchNorm",
    ),
    BadInput(
        "HF DPTrainer",
        "Embedding(max_norm=2.0) added to a GPT-2",
        _hf_trainer(model=_gpt2_with(lambda: nn.Embedding(4, 4, max_norm=2.0))),
        "max_norm",
    ),
    # noise_correlation='banded' (banded matrix factorization): combinations the banded-mf accountant does not cover
    BadInput(
        "DPStrategy",
        "noise_correlation='banded' without correlation_band",
        _strategy(noise_multiplier=1.0, noise_correlation="banded"),
        "needs correlation_band, an integer b >= 1",
    ),
    BadInput(
        "DPStrategy",
        "correlation_band=4 without noise_correlation",
        _strategy(noise_multiplier=1.0, correlation_band=4),
        "correlation_band=4 applies to noise_correlation='banded'",
    ),
    BadInput(
        "DPStrategy",
        "noise_correlation='toeplitz'",
        _strategy(noise_multiplier=1.0, noise_correlation="toeplitz"),
        "noise_correlation must be None, 'banded' or 'blt'",
    ),
    BadInput(
        "DPStrategy",
        "noise_correlation='blt', correlation_band=4",
        _strategy(noise_multiplier=1.0, noise_correlation="blt", correlation_band=4),
        "correlation_band=4 applies to noise_correlation='banded'",
    ),
    BadInput(
        "DPStrategy",
        "correlation_buffers=4 without noise_correlation='blt'",
        _strategy(noise_multiplier=1.0, correlation_buffers=4),
        "correlation_buffers=4 applies to noise_correlation='blt'; set that too",
    ),
    BadInput(
        "DPStrategy",
        "noise_correlation='blt', correlation_buffers=0",
        _strategy(noise_multiplier=1.0, noise_correlation="blt", correlation_buffers=0),
        "correlation_buffers must be an integer d >= 1",
    ),
    BadInput(
        "DPStrategy",
        "noise_correlation='blt', accountant='banded-mf'",
        _strategy(noise_multiplier=1.0, noise_correlation="blt", accountant="banded-mf"),
        "accountant='banded-mf' accounts for noise_correlation='banded' only",
    ),
    BadInput(
        "DPStrategy",
        "noise_correlation='banded', noise='laplace'",
        _strategy(noise="laplace", noise_params={"noise_scale": 1.0}, noise_correlation="banded", correlation_band=2),
        "correlates Gaussian noise: use noise='gaussian'",
    ),
    BadInput(
        "DPStrategy",
        "noise_correlation='banded', accountant='pld'",
        _strategy(noise_multiplier=1.0, accountant="pld", noise_correlation="banded", correlation_band=2),
        "accounted by accountant='banded-mf' only",
    ),
    BadInput(
        "DPStrategy",
        "accountant='banded-mf' without noise_correlation",
        _strategy(noise_multiplier=1.0, accountant="banded-mf"),
        "accounts for noise_correlation='banded' only",
    ),
    BadInput(
        "DPStrategy",
        "noise_correlation='banded', clipping='hutch'",
        _strategy(noise_multiplier=1.0, clipping="hutch", noise_correlation="banded", correlation_band=2),
        "needs an exact clipping engine, not clipping=.hutch.",
    ),
    BadInput(
        "DPStrategy",
        "noise_correlation='banded', target_unclipped_quantile=0.5",
        _strategy(noise_multiplier=1.0, target_unclipped_quantile=0.5, noise_correlation="banded", correlation_band=2),
        "with adaptive clipping is not supported",
    ),
    BadInput(
        "DPStrategy",
        "noise_correlation='banded', poisson_sampling=False",
        _strategy(noise_multiplier=1.0, poisson_sampling=False, noise_correlation="banded", correlation_band=2),
        "samples by cyclic Poisson sampling: keep poisson_sampling=True",
    ),
    BadInput(
        "Lightning fit",
        "noise_correlation='banded', correlation_band=10 at q = 8/64",
        _fit(_tiny(), {"noise_correlation": "banded", "correlation_band": 10}, max_steps=20),
        r"group rate b\*q=1.25 > 1: use a band <= 8",
    ),
    BadInput(
        "Lightning fit",
        "noise_correlation='banded', correlation_band=4 with max_steps=2",
        _fit(_tiny(), {"noise_correlation": "banded", "correlation_band": 4}),
        "correlation_band=4 exceeds the 2 planned steps",
    ),
    BadInput(
        "Lightning fit",
        "noise_correlation='blt' at q = 8/64 with max_steps=4",
        _fit(_tiny(), {"noise_correlation": "blt"}, max_steps=4),
        r"samples each example once every b = floor\(1 / q\) = 8 steps, more than the 4 planned",
    ),
    BadInput(
        "Lightning fit",
        "noise_correlation='banded' with a reordered Subset per epoch (reload_dataloaders_every_n_epochs=1)",
        _fit(
            _reordered_each_epoch,
            {"noise_correlation": "banded", "correlation_band": 2},
            max_steps=-1,
            max_epochs=2,
            reload_dataloaders_every_n_epochs=1,
        ),
        "must keep the same dataset object for the whole run",
    ),
    BadInput(
        "HF DPTrainer",
        "noise_correlation='banded': train(resume_from_checkpoint=...) with ignore_data_skip=False",
        _hf_skipping_resume(noise_correlation="banded", correlation_band=2),
        r"noise_correlation='banded' resumes only with TrainingArguments\(ignore_data_skip=True\)",
    ),
    BadInput(
        "HF DPTrainer",
        "exact_resume=True: train(resume_from_checkpoint=...) with ignore_data_skip=False",
        _hf_skipping_resume(exact_resume=True),
        r"exact_resume=True resumes only with TrainingArguments\(ignore_data_skip=True\)",
    ),
    BadInput(
        "HF DPTrainer",
        "exact_resume=True with push_to_hub=True, hub_strategy='checkpoint'",
        _hf_pushed_secret,
        r"exact_resume=True with push_to_hub and hub_strategy='checkpoint' would upload",
    ),
    # command line
    BadInput(
        "CLI",
        "lightning-dp epsilon ... --max-grad-norm -1",
        _cli("epsilon", *GAUSS, "--max-grad-norm", "-1", "--noise-multiplier", "1"),
        "error: --max-grad-norm must be a positive finite number, got -1.0",
    ),
    BadInput(
        "CLI",
        "lightning-dp calibrate ... --target-epsilon 1e6",
        _cli("calibrate", *GAUSS, "--target-epsilon", "1e6"),
        "error: --target-epsilon 1e[+]?0*6 needs .* or calibrate with --accountant rdp ",
    ),
    BadInput(
        "CLI",
        "lightning-dp epsilon ... (no --noise-multiplier)",
        _cli("epsilon", *GAUSS, "--max-grad-norm", "1"),
        "--noise-multiplier",
    ),
    BadInput(
        "CLI",
        "lightning-dp epsilon --noise gauss ...",
        _cli("epsilon", "--noise", "gauss", *GAUSS[2:], "--max-grad-norm", "1", "--noise-multiplier", "1"),
        "invalid choice",
    ),
    BadInput(
        "CLI",
        "lightning-dp calibrate --noise gaussian --search",
        _cli("calibrate", *GAUSS, "--target-epsilon", "1", "--search"),
        "--search",
    ),
    BadInput(
        "CLI",
        "lightning-dp epsilon --clipping hutch --noise laplace",
        _cli(
            "epsilon",
            "--noise",
            "laplace",
            *GAUSS[2:],
            "--max-grad-norm",
            "1",
            "--noise-scale",
            "1",
            "--clipping",
            "hutch",
            "--norm-dim",
            "8",
        ),
        "Gaussian noise only",
    ),
    BadInput(
        "CLI",
        "lightning-dp epsilon --accountant banded-mf (no --noise-correlation)",
        _cli("epsilon", *GAUSS, "--max-grad-norm", "1", "--noise-multiplier", "1", "--accountant", "banded-mf"),
        "accounts for correlated noise only; add --noise-correlation banded --correlation-band B",
    ),
    BadInput(
        "CLI",
        "lightning-dp calibrate --noise-correlation banded --correlation-band 8 --sample-rate 0.2",
        _cli(
            "calibrate",
            *GAUSS[:2],
            "--sample-rate",
            "0.2",
            *GAUSS[4:],
            "--target-epsilon",
            "3",
            "--noise-correlation",
            "banded",
            "--correlation-band",
            "8",
        ),
        r"group rate b\*q=1\.6 > 1: use a band <= 5",
    ),
    BadInput("CLI", "lightning-dp frobnicate", _cli("frobnicate"), "unknown command"),
    BadInput(
        "CLI",
        "lightning-dp tune --shape -0.5",
        _cli("tune", "--shape", "-0.5"),
        r"^lightning-dp tune: error: --shape must be 0 \(logarithmic\), positive \(1: geometric\) or inf \(Poisson\)",
    ),
    BadInput(
        "CLI",
        "lightning-dp tune --secure-mode --seed 1",
        _cli("tune", "--secure-mode", "--seed", "1"),
        "--secure-mode draws from the OS CSPRNG and takes no seed, got --seed 1$",
    ),
    # private hyper-parameter search (lightning_dp.tuning)
    BadInput(
        "private_search",
        "search_space={'batch_size': [64, 128]}",
        _private_search({"batch_size": [64, 128]}),
        r"^ValueError: search_space varies 'batch_size', which changes each candidate's privacy event",
    ),
    BadInput(
        "private_search",
        "RepetitionDistribution(mean=1, shape=1)",
        lambda: _repetitions(1.0, 1.0),
        r"^ValueError: mean_repetitions must be a finite number above 1",
    ),
    BadInput(
        "private_search",
        "SearchPlan(..., RepetitionDistribution(3, shape=-0.5))",
        _search_plan(-0.5),
        r"RepeatAndSelectDpEvent covers shape >= 0 only$",
    ),
    # YAML configs of lightning-dp fit (configs/digits_cnn.yaml, edited)
    BadInput(
        "YAML config",
        "strategy.init_args.max_grad_norm: -1.0",
        _yaml(_strategy_args(max_grad_norm=-1.0)),
        "max_grad_norm",
    ),
    BadInput("YAML config", "strategy.init_args.noise: gauss", _yaml(_strategy_args(noise="gauss")), "noise"),
    BadInput(
        "YAML config",
        "strategy.init_args.noise_multiplier: 1.0 (with target_epsilon)",
        _yaml(_strategy_args(noise_multiplier=1.0)),
        "exactly one",
    ),
    BadInput(
        "YAML config",
        "trainer.strategy: dp_epsilon_1 (not registered: the names are dp, dp_epsilon_3, dp_epsilon_8)",
        _yaml(_trainer_args(strategy="dp_epsilon_1")),
        "invalid strategy name.*dp_epsilon_1",
    ),
    BadInput(
        "YAML config",
        "strategy.init_args.secure_mode: true (with seed: 0)",
        _yaml(_strategy_args(secure_mode=True)),
        "secure_mode.*seed",
    ),
    BadInput(
        "YAML config",
        "strategy.init_args.check_batch_independence_every: 0",
        _yaml(_strategy_args(check_batch_independence_every=0)),
        "trainer.strategy.init_args.check_batch_independence_every: must be a positive whole number",
    ),
    BadInput(
        "YAML config",
        "trainer.gradient_clip_val: 1.0",
        _yaml(_trainer_args(gradient_clip_val=1.0)),
        "gradient_clip_val",
    ),
    BadInput(
        "YAML config",
        "strategy.init_args.max_grad_nrom: 2.0 (misspelt option)",
        _yaml(_strategy_args(max_grad_nrom=2.0)),
        r"^lightning-dp fit: error: bad.yaml: trainer.strategy.init_args.max_grad_nrom: unknown option; did you mean "
        r"'max_grad_norm'\?$",
    ),
    BadInput(
        "YAML config",
        "model.class_path: lightning_dp.tasks.digits.DigitCNN (misspelt class)",
        _yaml(lambda config: config["model"].update(class_path="lightning_dp.tasks.digits.DigitCNN")),
        r"^lightning-dp fit: error: bad.yaml: model.class_path: cannot import 'lightning_dp.tasks.digits.DigitCNN'; "
        r"did you mean 'lightning_dp.tasks.digits.DigitsCNN'\?$",
    ),
    BadInput(
        "YAML config",
        "strategy.init_args.max_grad_norm: abc",
        _yaml(_strategy_args(max_grad_norm="abc")),
        r"bad.yaml: trainer.strategy.init_args.max_grad_norm: expected float or list, got abc$",
    ),
    BadInput(
        "YAML config",
        "strategy.init_args.clipping: gohst",
        _yaml(_strategy_args(clipping="gohst")),
        r"bad.yaml: trainer.strategy.init_args.clipping: must be one of .*got 'gohst' \(did you mean 'ghost'\?\)$",
    ),
    BadInput(
        "CLI",
        "lightning-dp fit ... --trainer.strategy.init_args.max_grad_norm=-1",
        _yaml(lambda config: None, "--trainer.strategy.init_args.max_grad_norm=-1"),
        r"error: --trainer.strategy.init_args.max_grad_norm: must be a positive finite number, got -1.0; e.g. 1.0",
    ),
    # the HF recipes' YAML and flags (configs/glue_offline.yaml, edited)
    BadInput(
        "Recipe config",
        "per_sample_max_grad_nrom: 2.0 (misspelt key)",
        _recipe({"per_sample_max_grad_nrom": 2.0}),
        r"^recipes/glue.py: error: bad.yaml: per_sample_max_grad_nrom: unknown option; did you mean "
        r"'per_sample_max_grad_norm'\?$",
    ),
    BadInput(
        "Recipe config",
        "per_sample_max_grad_norm: -1.0",
        _recipe({"per_sample_max_grad_norm": -1.0}),
        r"bad.yaml: per_sample_max_grad_norm: must be a positive finite number, got -1.0; e.g. 1.0",
    ),
    BadInput(
        "Recipe config",
        "noise: gausian",
        _recipe({"noise": "gausian"}),
        r"bad.yaml: noise: Unknown noise 'gausian' \(did you mean 'gaussian'\?\)",
    ),
    BadInput(
        "Recipe flags",
        "--per_sample_max_grad_norm abc",
        _recipe({}, "--per_sample_max_grad_norm", "abc"),
        r"error: --per_sample_max_grad_norm: must be a number, or one number per clipping group .*got 'abc'$",
    ),
    BadInput(
        "Recipe flags",
        "--target_delta 2",
        _recipe({}, "--target_delta", "2"),
        r"error: --target_delta: must lie in \(0, 1\), got 2.0",
    ),
    # extension registries: a registration that would replace an entry is refused, and adds nothing
    BadInput(
        "Extension registry",
        "register_mechanism(PluginGaussian), a class with name = 'gaussian' (no override=True)",
        _refused_registration(_mechanisms, _register_mechanism_named_gaussian),
        r"^ValueError: mechanism 'gaussian' is already registered \(lightning_dp\.mechanisms\.gaussian\."
        r"GaussianMechanism\); pass override=True to replace it, or choose another name$",
    ),
    BadInput(
        "Extension registry",
        "register_engine(PluginGhost), a class with name = 'ghost' (no override=True)",
        _refused_registration(_engines, _register_engine_named_ghost),
        r"^ValueError: clipping engine 'ghost' is already registered "
        r"\(lightning_dp\.clipping\.engines\.ghost\.GhostEngine\); "
        r"pass override=True to replace it, or choose another name$",
    ),
    BadInput(
        "Extension registry",
        "register_layer(nn.Linear)(plugin_linear_terms) (no override=True)",
        _refused_registration(_layer_types, _register_layer_for_linear),
        r"^ValueError: layer type 'torch\.nn\.modules\.linear\.Linear' is already registered "
        r"\(lightning_dp\.clipping\.layers\.linear\.linear_terms\); pass override=True to replace it, or register it "
        r"for a subclass instead$",
    ),
]
