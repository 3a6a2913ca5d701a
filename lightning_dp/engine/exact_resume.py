"""``exact_resume=True``: the secret state a checkpoint then keeps, so that a resumed run continues the uninterrupted
one (docs/design.md section 2.3): the run's randomness
(:meth:`~lightning_dp.runtime.randomness.DPRandomness.state_dict`: base seed, restart count, generator states) and,
with ``noise_correlation``, each optimizer's noise stream
(:meth:`~lightning_dp.correlated_noise.CorrelatedNoise.state_dict`: the last ``b - 1`` outputs or the ``d`` buffers).
With both, the resumed steps draw the batches (the samplers are keyed by the step) and the noise of the uninterrupted
run, and the correlated noise's ledger stays one segment.

On an FSDP2-sharded model each rank draws its shards' noise from streams of their own and keeps its shards of the
correlated noise's state: the checkpoint gathers both (every rank's generator states, the state tensors at their full
values), and each rank of the resumed run takes back its own streams and shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_dp.accounting import Accountant
from lightning_dp.accounting.segments import SegmentedAccountant
from lightning_dp.correlated_noise.streaming import CorrelatedNoise
from lightning_dp.engine.run_state import RunState
from lightning_dp.optim.dp_optimizer import noised_params
from lightning_dp.runtime.sharding import gathered_part, is_sharded, part_like

#: the checkpoint entry (in the privacy state) that holds the secret state.
SECRET_KEY = "exact_resume"


def secret_state(run: RunState) -> dict[str, Any]:
    """``{"randomness": ..., "noise_streams": [...]}``: what :func:`restore_secret_state` continues from (a restored
    stream no optimizer has taken yet included). It reveals the noise: for a private resume file only
    (docs/privacy.md). On an FSDP2-sharded model a collective (every rank calls it): the generator states of every
    rank, and the streams' state tensors gathered to their full values (in CPU memory). On several processes only
    rank 0, which writes checkpoints, keeps the state tensors (``None`` on the others); ``"draw_schedule"``:
    :func:`draw_schedule`.

    Raises:
        RuntimeError: two ranks hold different states of one shared noise stream (they must draw identical noise).
    """
    keep = run.distributed is None or run.distributed.is_main  # the rank that writes checkpoints
    streams = [_full_stream_state(stream, params, keep) for stream, params in run.noise_streams]
    randomness = run.randomness.state_dict()
    if run.distributed is not None and run.clipper is not None and run.clipper.sharded:
        held = (randomness["generators"], run.randomness.untouched_streams)
        randomness["generators"] = _merged(run.distributed.gather_objects(held))
    schedule = run.restored_draw_schedule if run.restored_draw_schedule is not None else run.draw_schedule
    streams += list(run.restored_noise_streams or [])
    return {"randomness": randomness, "noise_streams": streams, "draw_schedule": schedule}


def _full_stream_state(stream: CorrelatedNoise, params: list[torch.Tensor], keep: bool) -> dict[str, Any]:
    """``stream.state_dict()`` with each state tensor at its parameter's full value (gathered from the ranks' shards
    of a sharded parameter), or ``None`` on a rank that does not ``keep`` them (it only takes part in the gathers)."""
    state = stream.state_dict()
    state["state"] = [
        [gathered_part(t, p, keep=keep) for t, p in zip(vector, params, strict=True)] for vector in state["state"]
    ]
    return state


def _merged(per_rank: list[tuple[dict[str, torch.Tensor], frozenset[str]]]) -> dict[str, torch.Tensor]:
    """One ``{stream name: generator state}`` of the ranks' streams (a shard's own on one rank, a shared one on all),
    from each rank's states and the names among them it holds as restored, untouched since: a stream another rank has
    drawn from is taken in that rank's state.

    Raises:
        RuntimeError: a stream held by several ranks in different states, untouched on none or on all of them.
    """
    merged: dict[str, torch.Tensor] = {}
    for untouched_pass in (False, True):  # the streams drawn from first, then what no rank touched since the restore
        found: dict[str, torch.Tensor] = {}
        for generators, untouched in per_rank:
            for name, generator_state in generators.items():
                if (name in untouched) != untouched_pass or name in merged:
                    continue
                if name in found and not torch.equal(found[name], generator_state):
                    raise RuntimeError(f"The ranks hold different states of the shared noise stream {name!r}")
                found[name] = generator_state
        merged.update(found)
    return merged


def restore_secret_state(run: RunState, saved: Any, accountant: Accountant) -> None:
    """Continue the checkpoint's streams instead of restarting them; the noise streams are handed to the optimizers by
    :func:`continued_stream`. Nothing changes when it raises.

    Args:
        run: the run's state.
        saved: the checkpoint's entry (:func:`secret_state`).
        accountant: the accountant holding the checkpoint's ledger.

    Raises:
        ValueError: a malformed entry; noise streams without ``noise_correlation`` or without the ledger's correlated
            steps (a stream must have taken exactly the steps of the ledger's last segment).
    """
    if (
        not isinstance(saved, dict)
        or not isinstance(saved.get("noise_streams"), list)
        or not isinstance(saved.get("randomness"), dict)
    ):
        raise ValueError(f"The checkpoint's {SECRET_KEY} entry is corrupted; resume from an intact checkpoint")
    streams = saved["noise_streams"]
    segments = accountant.segment_steps() if isinstance(accountant, SegmentedAccountant) else []
    steps = segments[-1] if segments else 0  # of the last segment: what each stream must have taken
    if any(not isinstance(s, dict) or s.get("step") != steps for s in streams) or (steps and not streams):
        raise ValueError(
            f"The checkpoint's noise streams ({[s.get('step') if isinstance(s, dict) else s for s in streams]} steps) "
            f"do not continue its ledger (last segment: {steps} steps); resume from an intact checkpoint"
        )
    schedule = saved.get("draw_schedule")
    randomness = saved["randomness"]
    drawn = steps > 0 or bool(randomness.get("generators"))  # noise was drawn
    if schedule is None and drawn and "layout" in saved:
        raise ValueError(
            f"The checkpoint's {SECRET_KEY} entry was written by an earlier version of lightning_dp, without the draw "
            "schedule a resume is checked against: resume it without exact_resume (the streams then restart)"
        )
    if (schedule is None and drawn) or (
        schedule is not None and not (isinstance(schedule, dict) and set(schedule) == set(SCHEDULE_KEYS))
    ):
        keys = sorted(schedule) if isinstance(schedule, dict) else type(schedule).__name__
        raise ValueError(
            f"The checkpoint's {SECRET_KEY} entry is corrupted (draw schedule: {keys}); resume from an intact "
            "checkpoint"
        )
    run.randomness.load_state_dict(saved["randomness"])
    run.restored_noise_streams = list(streams) if steps else None  # before any correlated step: nothing to continue
    run.restored_draw_schedule = schedule


def continues_segment(run: RunState) -> bool:
    """Whether this start of training continues the checkpoint's correlated noise (same segment of the ledger)."""
    return run.restored_noise_streams is not None


def continued_stream(run: RunState, params: Sequence[torch.Tensor]) -> CorrelatedNoise | None:
    """The next optimizer's correlated noise stream (``None`` without ``noise_correlation``): fresh, or on an exact
    resume the checkpoint's, continued (each state tensor this rank's part of the saved full value); kept in
    ``run.noise_streams`` with ``params`` for the next checkpoint.

    Args:
        run: the run's state.
        params: the parameters the optimizer noises, in the order of its draws (``DPOptimizer.params``).

    Raises:
        ValueError: the checkpoint's stream is of another kind or strategy, or holds tensors of other shapes than
            ``params``; more optimizers than the checkpoint's streams.
    """
    if run.correlation is None:
        return None
    stream = run.correlation.noise_stream()
    if run.restored_noise_streams is not None:
        if not run.restored_noise_streams:
            raise ValueError(
                "The checkpoint holds fewer noise streams than this run has optimizers: resume with the same optimizers"
            )
        stream.load_state_dict(_local_stream_state(run.restored_noise_streams.pop(0), params))
    run.noise_streams.append((stream, list(params)))
    return stream


def _local_stream_state(saved: dict[str, Any], params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """A saved stream state with each full state tensor replaced by this rank's part of it.

    Raises:
        ValueError: a state vector that does not hold one tensor of each parameter's shape.
    """
    vectors = saved.get("state")
    shapes = [tuple(p.shape) for p in params]
    if not isinstance(vectors, list) or any(
        not isinstance(vector, list | tuple)
        or [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in vector] != shapes
        for vector in vectors
    ):
        raise ValueError(
            f"The checkpoint's noise stream does not hold one tensor per parameter of this optimizer (shapes {shapes}):"
            " resume with the same model and optimizers"
        )
    return {**saved, "state": [[part_like(t, p) for t, p in zip(vector, params, strict=True)] for vector in vectors]}


def check_draw_schedule(
    run: RunState, optimizers: Sequence[torch.optim.Optimizer], checks: Callable[[], None] = lambda: None
) -> None:
    """Before the optimizers are wrapped: the run draws its noise on the schedule the checkpoint's streams were drawn
    on (:func:`draw_schedule`). A start from the restored state that does not finish (:func:`finish_restore`) stays
    refused, and so does any load no start followed (:func:`abandon_load`): a later start of this run (a ``fit``
    without ``ckpt_path``, which would continue the restored streams with its own optimizer state and randomness, or
    the loaded ledger without the loaded weights) is refused until a checkpoint is loaded again, and a checkpoint
    written meanwhile records the checkpoint's schedule.

    Raises:
        ValueError: as ``checks``, the caller's checks of the optimizers (run once the start counts as started, so
            that their refusal stays too); the checkpoint's noise was drawn on other processes, devices or sharding,
            over another dataset size, or for other trainable parameters (the streams continued here would add draws
            already added, to other gradients: docs/privacy.md); an earlier start from the same restore failed, or a
            load that no start followed.
    """
    schedule, restored = draw_schedule(run, optimizers), run.restored_draw_schedule
    if run.stale_load or (restored is not None and run.resume_started):
        raise ValueError(
            "A checkpoint loaded into this run was not trained from (the fit that loaded it failed or had no step "
            "left, or validate, test or predict loaded it): continuing could mix its state with this run's (its "
            "privacy ledger without its weights or the reverse, or its noise streams on other gradients); fit from a "
            "checkpoint again (ckpt_path / resume_from_checkpoint), which loads it afresh"
        )
    run.resume_started = restored is not None
    checks()
    if restored is not None and restored != schedule:
        raise ValueError(
            f"exact_resume: the checkpoint's noise was drawn {_difference(restored, schedule)}: resume with the same "
            "processes, devices, sharding, dataset and trainable parameters, or without exact_resume (a resume then "
            "draws fresh streams)"
        )
    run.draw_schedule = schedule


def abandon_load(run: RunState) -> None:
    """A fit of the run begins (before it loads a checkpoint): a load that changed the run
    (``CheckpointState.begin_load``) and that no start of training has followed (:func:`finish_restore`), because the
    fit that made it failed after it (or, under Lightning, had no step left) or it was a validate, test or predict, may
    have changed only part of the run (Lightning loads the model's weights after the privacy state, its
    ``ModelParallelStrategy`` before it is checked); :func:`check_draw_schedule` refuses this fit unless it loads a
    checkpoint itself."""
    if run.load_unfinished:
        run.stale_load = True


def finish_restore(run: RunState) -> None:
    """Once the optimizers are wrapped: an exact resume's noise streams are all taken (a later ``fit`` of this run
    restarts the correlation), and its draw schedule is this run's.

    Raises:
        ValueError: the checkpoint holds more noise streams than this run has optimizers.
    """
    left, run.restored_noise_streams = run.restored_noise_streams, None
    if left:
        raise ValueError(
            f"The checkpoint holds {len(left)} noise stream(s) more than this run has optimizers: resume with the same "
            "optimizers"
        )
    run.restored_draw_schedule, run.resume_started = None, False
    run.load_unfinished = run.load_partial = False  # training starts from what was loaded


def draw_schedule(run: RunState, optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    """What the run's noise draws are laid on, the same on every rank: ``{"world_size": W, "devices": [device types],
    "meshes": [[mesh ndim, *mesh shape], ...], "num_samples": N, "params": [[[name, [*global shape], dtype,
    placements], ...] per optimizer]}``, the parameters in the order the optimizer noises them (:func:`noised_params`;
    ``name`` is the clipped model's, ``None`` for a parameter outside it; ``placements`` a sharded parameter's, else
    ``None``)."""
    names = {} if run.clipper is None else {p: name for name, p in run.clipper.module.named_parameters()}
    noised = [noised_params(optimizer) for optimizer in optimizers]
    params = [p for group in noised for p in group]
    meshes = {(p.device_mesh.ndim, *p.device_mesh.shape) for p in params if is_sharded(p)}
    return {
        "world_size": 1 if run.distributed is None else run.distributed.world_size,
        "devices": sorted({p.device.type for p in params}),
        "meshes": [list(mesh) for mesh in sorted(meshes)],
        "num_samples": run.num_samples,
        "params": [
            [[names.get(p), list(p.shape), str(p.dtype), _placements(p) if is_sharded(p) else None] for p in group]
            for group in noised
        ],
    }


def _placements(param: torch.Tensor) -> list[list[Any]]:
    """A sharded parameter's placements over its mesh's dimensions: ``[[kind, sharded dimension or None], ...]``."""
    return [[type(p).__name__, getattr(p, "dim", None)] for p in param.placements]  # type: ignore[attr-defined]


def _difference(restored: dict[str, Any], schedule: dict[str, Any]) -> str:
    """``"<what> <the checkpoint's>, this run draws it <what> <this run's>"`` for the first key of
    :data:`SCHEDULE_KEYS` that differs (of the parameters, the first that differs)."""
    key = next(k for k in SCHEDULE_KEYS if restored.get(k) != schedule[k])
    saved, here = restored.get(key), schedule[key]
    if key == "params" and isinstance(saved, list):
        flat_saved, flat_here = (
            [(o, *entry) for o, entries in enumerate(lists) for entry in entries] for lists in (saved, here)
        )
        i = next((i for i, (a, b) in enumerate(zip(flat_saved, flat_here, strict=False)) if a != b), None)
        i = min(len(flat_saved), len(flat_here)) if i is None else i
        saved, here = (flat[i] if i < len(flat) else "no parameter" for flat in (flat_saved, flat_here))
    what = _DRAWN_OVER[key]
    return f"{what} {saved}, this run draws it {what} {here}"


#: the keys of :func:`draw_schedule`, in the order :func:`_difference` compares them, and how it names each.
_DRAWN_OVER = {
    "world_size": "on world size",
    "devices": "on devices",
    "meshes": "on meshes",
    "num_samples": "over a dataset of size",
    "params": "for (optimizer, name, shape, dtype, placements)",
}
SCHEDULE_KEYS = tuple(_DRAWN_OVER)
