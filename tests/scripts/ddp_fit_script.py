"""Run by tests/engine/test_ddp.py: ``python ddp_fit_script.py OUT_DIR [--max-epochs E] [--resume CKPT]
[--independence-every N] [--seed S] [--poison] [--users] [--adaptive] [--banded B | --blt D] [--sample-rate Q]
[--exact-resume] [--estimate-steps] [--unseeded]``
trains TinyRegressor with DPDDPStrategy on 2 CPU processes through
Lightning's own launcher; every rank writes what it ended with to ``OUT_DIR/rank{r}.pt`` (checkpoints, with
``--max-epochs``, go to ``OUT_DIR/ckpt``), including the optimizer steps on which its batch-independence checks
ran and the bound each step clipped at (:class:`ClipBoundRecorder`). ``--users``: user-level privacy, the user a
function of the example (``helpers.example_user``), 2 users per rank and micro-batch in expectation. ``--adaptive``:
adaptive clipping (``helpers.ADAPTIVE_OPTIONS``). ``--banded B``: ``noise_correlation='banded'`` with
``correlation_band=B`` (seed 0 unless ``--seed``), at ``--sample-rate Q`` when given; ``--blt D`` likewise with
``noise_correlation='blt'`` and ``correlation_buffers=D``; every rank also writes the dataset indices of each of its
batches (``batches``, empty without correlated noise) and its sampler's partition (``groups``, ``None`` without).
``--exact-resume``: ``exact_resume=True``. ``--estimate-steps``: the module's ``setup`` reads
``trainer.estimated_stepping_batches`` (Lightning's pattern for a schedule of the run's length), which builds the
training loader before Lightning restores a checkpoint and before the clipping hooks are attached. ``--unseeded``:
``seed=None`` (OS entropy, rank 0's shared), also with ``--banded`` / ``--blt``."""

import argparse
import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dp import DPDDPStrategy, PrivacyAccountantCallback
from lightning_dp.checks import guard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from helpers import ADAPTIVE_OPTIONS, USER_OPTIONS, BatchIndexRecorder, ClipBoundRecorder, TinyRegressor, make_trainer


class EstimatingRegressor(TinyRegressor):
    def setup(self, stage: str) -> None:
        assert self.trainer.estimated_stepping_batches > 0  # builds the training loader


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--independence-every", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--poison", action="store_true", help="example 3 of the data is NaN; seed 0, q = 0.5")
    parser.add_argument("--users", action="store_true", help="privacy_unit='user' (USER_OPTIONS), batch 2 users")
    parser.add_argument("--adaptive", action="store_true", help="adaptive clipping (ADAPTIVE_OPTIONS)")
    parser.add_argument("--banded", type=int, default=None, help="noise_correlation='banded', this band")
    parser.add_argument("--blt", type=int, default=None, help="noise_correlation='blt', these buffers")
    parser.add_argument("--sample-rate", type=float, default=None)
    parser.add_argument("--exact-resume", action="store_true")
    parser.add_argument("--estimate-steps", action="store_true")
    parser.add_argument("--unseeded", action="store_true")
    args = parser.parse_args()
    checked: dict[str, list[int]] = {"gradient": [], "leave_half_out": []}
    torch.manual_seed(0)  # the same data on every rank; the parameters are broadcast from rank 0 anyway
    module = (EstimatingRegressor if args.estimate_steps else TinyRegressor)(batch_size=2 if args.users else 8)
    if args.poison:
        module.data.tensors[0][3] = float("nan")
    initial = [p.detach().clone() for p in module.parameters()]
    options = dict(seed=0, sample_rate=0.5) if args.poison else dict(seed=args.seed)
    if args.users:
        options.update(USER_OPTIONS)
    if args.adaptive:
        options.update(ADAPTIVE_OPTIONS)
    if args.banded is not None:
        options.update(noise_correlation="banded", correlation_band=args.banded, seed=args.seed or 0)
    if args.blt is not None:
        options.update(noise_correlation="blt", correlation_buffers=args.blt, seed=args.seed or 0)
    correlated = args.banded is not None or args.blt is not None
    if args.sample_rate is not None:
        options["sample_rate"] = args.sample_rate
    if args.exact_resume:
        options["exact_resume"] = True
    if args.unseeded:
        options["seed"] = None
    strategy = DPDDPStrategy(
        noise_multiplier=1.0, max_grad_norm=0.5, check_batch_independence_every=args.independence_every, **options
    )

    def recording(kind, check):
        def run(*check_args):
            checked[kind].append(strategy.privacy_engine.steps)
            return check(*check_args)

        return run

    guard.check_batch_independence = recording("gradient", guard.check_batch_independence)
    guard.check_leave_half_out = recording("leave_half_out", guard.check_leave_half_out)
    recorder = ClipBoundRecorder()
    indices = BatchIndexRecorder(module.data.tensors[0])  # TensorDataset batches of distinct, finite rows only
    callbacks = [PrivacyAccountantCallback(), recorder, *([indices] if correlated else [])]
    if args.max_epochs is None:
        trainer = make_trainer(strategy, devices=2, max_steps=6, callbacks=callbacks)
    else:
        callbacks.append(ModelCheckpoint(dirpath=args.out / "ckpt", every_n_epochs=1, save_top_k=-1))
        trainer = make_trainer(
            strategy, devices=2, max_epochs=args.max_epochs, callbacks=callbacks, enable_checkpointing=True
        )
    trainer.fit(module, ckpt_path=args.resume)
    engine = strategy.privacy_engine
    torch.save(
        {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "params": [p.detach().clone() for p in module.parameters()],
            "initial": initial,
            "epsilon": engine.epsilon(),
            "steps": engine.steps,
            "global_step": trainer.global_step,
            "sample_rate": engine.sample_rate,
            "num_samples": engine.num_samples,
            "delta": engine.target_delta,
            "ledger": engine.accountant.state_dict(),
            "summary": callbacks[0].summary,
            "dropped_nonfinite": engine.dropped_nonfinite,
            "checked_steps": checked,
            "bounds": recorder.bounds,
            "final_bound": engine.current_max_grad_norm,
            "batches": indices.batches,
            "groups": trainer.train_dataloader.batch_sampler.groups if correlated else None,
        },
        args.out / f"rank{trainer.global_rank}.pt",
    )
