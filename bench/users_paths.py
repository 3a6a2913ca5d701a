"""Time of the WHOLE training step through the users' paths: DP against non-private, per framework, in one run.

Paths and variants (the same weights, the same fixed batches within a path):
- ``--model gpt2`` (tiny GPT-2 built from a config, no download: 2 layers, d=256, 4 heads, the 50257-token GPT-2
  vocabulary with ``lm_head`` tied to ``wte``; ``--seq-len`` T, ``--batch-size`` B, fused AdamW lr 1e-4 as
  HF's default):
  ``lightning-plain`` (``lightning.Trainer``, the module's mean loss) against ``lightning-dp-<clipping>``
  (``Trainer(strategy=DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, clipping=..., poisson_sampling=False,
  seed=0))`` on the same LightningModule returning the per-sample loss); ``hf-plain`` (``transformers.Trainer``, its
  default gradient clipping ``max_grad_norm=1.0``, its default AdamW) against ``hf-dp-<clipping>`` (``DPTrainer``
  with ``PrivacyArguments(noise_multiplier=1.0, per_sample_max_grad_norm=1.0, poisson_sampling=False, dp_seed=0,
  clipping=...)``).
- ``--model digits`` (the CNN of configs/digits_cnn.yaml: ``DigitsCNN``, SGD lr 1.0 momentum 0.5, the train split of
  ``DigitsDataModule``, batch 128 in a fixed order, the last incomplete batch dropped): ``lightning-plain`` against
  ``lightning-dp-<clipping>`` as above; beside them ``torch-plain`` (a plain PyTorch loop on the same network) against
  ``opacus`` (``opacus.PrivacyEngine().make_private(noise_multiplier=1.0, max_grad_norm=1.0,
  poisson_sampling=False)`` on the same network and loader), so that the ratio DP / plain can be compared across
  libraries.

Time: every variant drives its framework's own per-step code: each round runs, for every variant in turn (the order
rotating every round), one short ``Trainer.fit`` / ``Trainer.train`` (a fresh Trainer and, for DP, a fresh strategy
or DPTrainer on the variant's persistent model) of ``--steps-per-round`` optimizer steps; the plain PyTorch and
Opacus variants run as many steps of their loops. A callback (Lightning: ``on_train_batch_start`` /
``on_train_batch_end``; HF: ``on_step_begin`` / ``on_step_end``) reads the clocks around each step, which thus
includes the strategy's or trainer's hooks, the clipping, the noise and the optimizer step, but not the data
loading. The first ``--skip-first`` steps of each fit are left out (default 1: the first step of a DP run runs the
batch-independence check, which a real run pays once). Load changes on a shared machine hit all variants alike. On
CPU the ratios use the process's CPU time per step (``time.process_time``) with ``--threads`` intra-op threads
(default 1), the wall time is printed beside; on CUDA the wall time between synchronisations. Reported per variant:
the median over all kept steps of the time per step divided by the examples in it, and the ratio to the plain
variant of its path; beside it the spread, the lowest and highest of the rounds' ratios (each round's median over
its kept steps against the plain variant's in the same round).

Breakdown (unless ``--no-breakdown``): after the timed rounds, one more fit per DP variant of this library with
timing wrappers monkeypatched (in this script only) around the engine's parts, each counted exclusive of the parts
it calls: ``PrivacyEngine.per_sample_loss`` split into the user's forward (``compute_loss``), the extra forwards of
the checks (``replay``) and the rest of the sequence (guard, checks); ``PrivacyEngine.clip`` (the clipper's
backward); ``DPOptimizer.privatise`` (the noise); the wrapped optimizer's ``step``; the rest of the step
(Lightning / HF and the adapters) is the step time minus these. Means over the kept steps, so the parts add up.

Usage: ``python bench/users_paths.py --model gpt2 --seq-len 128 --batch-size 8 [--clipping flat ghost] [--json]``,
``python bench/users_paths.py --model gpt2 --seq-len 512 --device cuda``,
``python bench/users_paths.py --model digits [--rounds 5 --steps-per-round 5]``
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from records import add_record_options, environment, finish
from step_profile import StepProfiler, extra_operators
from users_paths_report import PARTS, RECORDS, render, report_lines

from lightning_dp.utils.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]

PATHS = {"gpt2": ("lightning", "hf"), "digits": ("lightning", "torch")}
DP_OF = {"lightning": "lightning-dp", "hf": "hf-dp", "torch": "opacus"}


# ----------------------------------------------------------------------------------------------------- clocks
class Clocks:
    """Per-step CPU and wall time (synchronised on CUDA), plus the engine parts while ``parts_on``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps: list[dict[str, float]] = []
        self.parts_on = False
        self._parts: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []
        self._start: tuple[float, float] | None = None
        self._examples = 0
        self.profiler: StepProfiler | None = None  # --profile: around each step of the profiled round

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def now(self) -> float:
        """The clock the ratios use: CPU time on CPU, wall time on CUDA."""
        self.sync()
        return time.process_time() if self.device.type == "cpu" else time.perf_counter()

    def begin(self, examples: int) -> None:
        if self.profiler is not None:
            self.profiler.begin()
        self.sync()
        self._start = (time.process_time(), time.perf_counter())
        self._parts.clear()
        self._examples = examples

    def end(self) -> None:
        if self._start is None:
            return
        self.sync()
        cpu, wall = time.process_time() - self._start[0], time.perf_counter() - self._start[1]
        self.steps.append({"cpu": cpu, "wall": wall, "examples": self._examples, **self._parts})
        self._start = None
        if self.profiler is not None:
            self.profiler.end()

    def timed(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` counting its time, exclusive of nested timed parts, into part ``name`` while ``parts_on``."""

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.parts_on or self._start is None:
                return function(*args, **kwargs)
            start = self.now()
            self._stack.append(0.0)
            try:
                return function(*args, **kwargs)
            finally:
                inner = self._stack.pop()
                elapsed = self.now() - start
                self._parts[name] += elapsed - inner
                if self._stack:
                    self._stack[-1] += elapsed

        return wrapper


def patch_engine(clocks: Clocks) -> Callable[[], None]:
    """Wrap the engine's parts with ``clocks.timed``; returns the function that undoes it."""
    from lightning_dp.engine.privacy_engine import PrivacyEngine
    from lightning_dp.optim import DPOptimizer

    originals = {
        (PrivacyEngine, "per_sample_loss"): PrivacyEngine.per_sample_loss,
        (PrivacyEngine, "clip"): PrivacyEngine.clip,
        (DPOptimizer, "privatise"): DPOptimizer.privatise,
        (DPOptimizer, "step"): DPOptimizer.step,
    }
    per_sample_loss, step = PrivacyEngine.per_sample_loss, DPOptimizer.step

    def timed_per_sample_loss(self, batch, batch_size, compute_loss, *, replay=None, **options):
        replay = replay or compute_loss
        timed_compute_loss = clocks.timed("user forward", compute_loss)
        return per_sample_loss(
            self, batch, batch_size, timed_compute_loss, replay=clocks.timed("check forwards", replay), **options
        )

    def step_with_timed_optimizer(self, closure=None):
        inner = self.original_optimizer
        if not getattr(inner.step, "_bench_timed", False):
            inner.step = clocks.timed("opt step", inner.step)
            inner.step._bench_timed = True
        return step(self, closure)

    PrivacyEngine.per_sample_loss = clocks.timed("per_sample_loss rest", timed_per_sample_loss)
    PrivacyEngine.clip = clocks.timed("clip (backward)", PrivacyEngine.clip)
    DPOptimizer.privatise = clocks.timed("privatise (noise)", DPOptimizer.privatise)
    DPOptimizer.step = step_with_timed_optimizer

    def undo() -> None:
        for (owner, name), function in originals.items():
            setattr(owner, name, function)

    return undo


# ----------------------------------------------------------------------------------------------------- models
def tiny_gpt2(seq_len: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=256, n_head=4, n_positions=seq_len, vocab_size=50257,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).train()


def token_batches(args: argparse.Namespace) -> torch.Tensor:
    """``B * steps_per_round`` fixed random token sequences: one fit is one epoch in a fixed order."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 50257, (args.batch_size * args.steps_per_round, args.seq_len), generator=generator)


def lightning_gpt2_module(model: torch.nn.Module, mean_loss: bool):
    import lightning.pytorch as pl

    class TinyGPT2(pl.LightningModule):
        """Causal LM step: per-sample mean token cross-entropy ``[B]`` (its mean when ``mean_loss``)."""

        def __init__(self) -> None:
            super().__init__()
            self.model, self.mean_loss = model, mean_loss

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            logits = self.model(tokens).logits
            token_loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none"
            )
            loss = token_loss.view(tokens.shape[0], -1).mean(dim=1)
            return loss.mean() if self.mean_loss else loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)  # HF's default optimizer

    return TinyGPT2()


def digits_setup():
    """The digits CNN (seed 0) and a fixed-order loader of the train split in batches of 128 (last one dropped)."""
    from torch.utils.data import DataLoader

    from lightning_dp.tasks.digits import DigitsCNN, DigitsDataModule

    class BenchDigitsCNN(DigitsCNN):
        """``DigitsCNN`` whose step returns the mean of its per-sample loss when ``mean_loss`` (plain training)."""

        mean_loss = False

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss.mean() if self.mean_loss else loss

    torch.manual_seed(0)
    module = BenchDigitsCNN(lr=1.0, momentum=0.5)
    data = DigitsDataModule(batch_size=128)
    data.setup("fit")
    loader = DataLoader(data.train_set, batch_size=128, shuffle=False, drop_last=True)
    return module, loader


# ----------------------------------------------------------------------------------------------------- variants
class LightningVariant:
    def __init__(self, name, module, loader, clipping, clocks, args) -> None:
        self.name, self.module, self.loader, self.clipping, self.clocks, self.args = (
            name, module, loader, clipping, clocks, args,
        )  # fmt: skip

    def run_round(self) -> None:
        import lightning.pytorch as pl

        from lightning_dp import DPStrategy

        clocks, device = self.clocks, self.args.device

        class StepClock(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                clocks.begin(len(batch[0]))

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                clocks.end()

        options: dict[str, Any] = {}
        if self.clipping is not None:
            options["strategy"] = DPStrategy(
                noise_multiplier=1.0, max_grad_norm=1.0, clipping=self.clipping, poisson_sampling=False, seed=0,
                device=device,
            )  # fmt: skip
        trainer = pl.Trainer(
            accelerator="gpu" if device.startswith("cuda") else "cpu", devices=1, max_steps=self.args.steps_per_round,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, callbacks=[StepClock()], **options,
        )  # fmt: skip
        trainer.fit(self.module, train_dataloaders=self.loader)


class HFVariant:
    def __init__(self, name, model, tokens, clipping, clocks, args) -> None:
        self.name, self.model, self.tokens, self.clipping, self.clocks, self.args = (
            name, model, tokens, clipping, clocks, args,
        )  # fmt: skip
        self.output_dir = tempfile.mkdtemp(prefix="bench_users_paths_")

    def run_round(self) -> None:
        from torch.utils.data import Dataset
        from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

        from lightning_dp.hf import DPTrainer, PrivacyArguments

        clocks, batch_size, tokens = self.clocks, self.args.batch_size, self.tokens

        class StepClock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clocks.begin(batch_size)

            def on_step_end(self, args, state, control, **kwargs):
                clocks.end()

        class Tokens(Dataset):
            def __len__(self) -> int:
                return len(tokens)

            def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
                return {"input_ids": tokens[i], "labels": tokens[i]}

        arguments = TrainingArguments(
            output_dir=self.output_dir, per_device_train_batch_size=batch_size, max_steps=self.args.steps_per_round,
            learning_rate=1e-4, report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
            dataloader_pin_memory=False, use_cpu=self.args.device == "cpu",
            **({} if self.clipping is None else {"max_grad_norm": 0.0}),
        )  # fmt: skip
        common = dict(model=self.model, args=arguments, train_dataset=Tokens(), callbacks=[StepClock()])
        if self.clipping is None:
            trainer = Trainer(**common)
        else:
            privacy = PrivacyArguments(
                noise_multiplier=1.0, per_sample_max_grad_norm=1.0, poisson_sampling=False, dp_seed=0,
                clipping=self.clipping,
            )  # fmt: skip
            trainer = DPTrainer(**common, privacy_args=privacy)
        trainer.remove_callback(PrinterCallback)  # the end-of-train metrics line
        trainer.train()


class TorchVariant:
    """A plain PyTorch loop (``opacus=False``) or the same loop made private by Opacus's ``make_private``."""

    def __init__(self, name, net, loader, opacus, clocks, args) -> None:
        self.name, self.clocks, self.args = name, clocks, args
        device = torch.device(args.device)
        net = net.to(device).train()
        optimizer = torch.optim.SGD(net.parameters(), lr=1.0, momentum=0.5)
        if opacus:
            from opacus import PrivacyEngine as OpacusEngine

            net, optimizer, loader = OpacusEngine().make_private(
                module=net, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                poisson_sampling=False,
            )  # fmt: skip
        self.net, self.optimizer, self.loader, self.device = net, optimizer, loader, device
        self.batches = iter(())

    def _next(self):
        try:
            return next(self.batches)
        except StopIteration:
            self.batches = iter(self.loader)
            return next(self.batches)

    def run_round(self) -> None:
        for _ in range(self.args.steps_per_round):
            x, y = (t.to(self.device) for t in self._next())
            self.clocks.begin(len(x))
            self.optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(self.net(x), y).backward()
            self.optimizer.step()
            self.clocks.end()


def build_variants(args: argparse.Namespace) -> list:
    device = torch.device(args.device)
    variants = []

    def clocks() -> Clocks:
        return Clocks(device)

    if args.model == "gpt2":
        base = tiny_gpt2(args.seq_len)
        tokens = token_batches(args)
        from torch.utils.data import DataLoader, TensorDataset

        loader = DataLoader(TensorDataset(tokens), batch_size=args.batch_size, shuffle=False)
        if "lightning" in args.paths:
            for clipping in (None, *args.clipping):
                name = "lightning-plain" if clipping is None else f"lightning-dp-{clipping}"
                module = lightning_gpt2_module(copy.deepcopy(base), mean_loss=clipping is None)
                variants.append(LightningVariant(name, module, loader, clipping, clocks(), args))
        if "hf" in args.paths:
            for clipping in (None, *args.clipping):
                name = "hf-plain" if clipping is None else f"hf-dp-{clipping}"
                variants.append(HFVariant(name, copy.deepcopy(base), tokens, clipping, clocks(), args))
        return variants
    base, loader = digits_setup()
    if "lightning" in args.paths:
        for clipping in (None, *args.clipping):
            name = "lightning-plain" if clipping is None else f"lightning-dp-{clipping}"
            module = copy.deepcopy(base)
            module.mean_loss = clipping is None
            variants.append(LightningVariant(name, module, loader, clipping, clocks(), args))
    if "torch" in args.paths:
        for opacus in (False, True):
            name = "opacus" if opacus else "torch-plain"
            variants.append(TorchVariant(name, copy.deepcopy(base.net), loader, opacus, clocks(), args))
    return variants


# ----------------------------------------------------------------------------------------------------- running
def _kept(steps: list[dict[str, float]], args: argparse.Namespace, per_round: int) -> list[dict[str, float]]:
    """The steps of each round after its first ``--skip-first`` (rounds of ``per_round`` steps)."""
    return [s for i, s in enumerate(steps) if i % per_round >= args.skip_first]


def _round_medians(steps: list[dict[str, float]], args: argparse.Namespace, per_round: int, key: str) -> list[float]:
    """Per round, the median over its kept steps of ``key`` time per example (rounds without a kept step left out)."""
    rounds = [_kept(steps[start : start + per_round], args, per_round) for start in range(0, len(steps), per_round)]
    return [statistics.median(s[key] / s["examples"] for s in kept) for kept in rounds if kept]


def run(args: argparse.Namespace) -> dict[str, Any]:
    variants = build_variants(args)
    for round_ in range(args.rounds):
        shift = round_ % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            variant.run_round()
    per_round = args.steps_per_round
    results: dict[str, dict[str, Any]] = {}
    for variant in variants:
        kept = _kept(variant.clocks.steps, args, per_round)
        if not kept:
            results[variant.name] = {"error": "no step kept (raise --steps-per-round above --skip-first)"}
            continue
        results[variant.name] = {
            "steps": len(kept),
            "cpu_per_example": statistics.median(s["cpu"] / s["examples"] for s in kept),
            "wall_per_example": statistics.median(s["wall"] / s["examples"] for s in kept),
        }
    key = "cpu" if args.device == "cpu" else "wall"
    timed_by = f"{key}_per_example"
    by_name = {variant.name: variant for variant in variants}
    for variant in variants:
        row, path = results[variant.name], variant.name.split("-")[0]
        plain_name = f"{path}-plain" if path != "opacus" else "torch-plain"
        plain = results.get(plain_name, {})
        if timed_by in row and timed_by in plain:
            row["ratio"] = row[timed_by] / plain[timed_by]
            if variant.name != plain_name:  # the spread: each round's ratio of medians
                own = _round_medians(variant.clocks.steps, args, per_round, key)
                base = _round_medians(by_name[plain_name].clocks.steps, args, per_round, key)
                row["round_ratios"] = [a / b for a, b in zip(own, base, strict=True)]
    breakdown: dict[str, dict[str, float]] = {}
    if not args.no_breakdown:
        for variant in variants:
            if "-dp-" not in variant.name:
                continue
            clocks = variant.clocks
            clocks.steps.clear()
            clocks.parts_on = True
            undo = patch_engine(clocks)
            try:
                variant.run_round()
            finally:
                undo()
                clocks.parts_on = False
            kept = _kept(clocks.steps, args, per_round)
            if not kept:
                continue
            mean = {part: statistics.fmean(s.get(part, 0.0) for s in kept) for part in PARTS}
            mean["step"] = statistics.fmean(s[key] for s in kept)
            mean["rest (framework, adapter)"] = mean["step"] - sum(mean[part] for part in PARTS)
            mean["examples"] = statistics.fmean(s["examples"] for s in kept)
            breakdown[variant.name] = mean
    profiles = profile_variants(variants, args) if args.profile else {}
    return {"results": results, "breakdown": breakdown, "profile": profiles, "order": [v.name for v in variants]}


def profile_variants(variants: list, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``--rounds`` more rounds under the torch profiler, interleaved as the timed ones (the kept steps only); per DP
    variant, the operators it spends the most time on beyond its path's plain variant, medians over the profiled
    steps (bench/step_profile.py)."""
    device = torch.device(args.device)
    profilers = {variant.name: StepProfiler(device) for variant in variants}
    for round_ in range(args.rounds):
        shift = round_ % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            profiler = variant.clocks.profiler = profilers[variant.name]
            profiler.skip(args.skip_first)
            try:
                variant.run_round()
            finally:
                variant.clocks.profiler = None
    rows = {name: profiler.rows() for name, profiler in profilers.items()}
    out = {}
    for name, dp in rows.items():
        path = name.split("-")[0]
        plain = rows.get("torch-plain" if path == "opacus" else f"{path}-plain")
        if name.endswith("-plain") or plain is None:
            continue
        out[name] = extra_operators(dp, plain, device=device.type == "cuda", top=args.profile)
    return out


def quiet() -> None:
    """Silence the per-fit banners and the expected warnings (poisson_sampling=False, no accountant output)."""
    import lightning.pytorch  # noqa: F401 (sets its loggers' levels on import: import first, then lower them)

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_dp", "transformers", "opacus"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", choices=tuple(PATHS), default="gpt2")
    parser.add_argument("--paths", nargs="+", choices=("lightning", "hf", "torch"), default=None,
                        help="paths to run (default: lightning hf for gpt2, lightning torch for digits)")  # fmt: skip
    parser.add_argument("--clipping", nargs="+", default=["flat"], help="DP clipping engines (default flat)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--skip-first", type=int, default=1, help="steps left out at the start of each fit")
    parser.add_argument("--batch-size", type=int, default=None, help="default 8 (gpt2); digits is always 128")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1)")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the breakdown of the DP step")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile one more round per variant; record the N operators the DP step spends the "
                        "most time on beyond the plain step (default 0: no profile)")  # fmt: skip
    add_record_options(parser, RECORDS.relative_to(ROOT))
    args = parser.parse_args()
    if args.render:
        render()
        return
    args.paths = [p for p in (args.paths or PATHS[args.model]) if p in PATHS[args.model]]
    args.batch_size = 128 if args.model == "digits" else (args.batch_size or 8)
    torch.set_num_threads(args.threads)
    quiet()
    env = environment(args.device)
    out = run(args)
    finish(args, out, env, script="bench/users_paths.py", records=RECORDS, render=render, report_lines=report_lines)


if __name__ == "__main__":
    main()
