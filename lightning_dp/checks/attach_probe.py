"""A clipped forward at attach on the model's example inputs (Lightning ``example_input_array``, HF
``dummy_inputs`` or inputs built from an HF model's config: :mod:`lightning_dp.checks.probe_inputs`), so that what
only a forward shows is refused before training, not at its first step: a parameter read outside its module's
forward, a layer applied to rows that are not examples, a module the exact fallback cannot rerun (docs/design.md
section 9.1).

The inputs are the model's own or drawn from a generator of their own (a Lightning ``example_input_array`` may be a
real example: it is used like a batch of the training data, nothing of it is released). The model's mode, buffers and
the global RNGs (torch, numpy, ``random``: HF audio models draw their SpecAugment masks and layer drop from numpy's)
are restored; nothing is written to ``.grad``. A model that cannot be probed gets one INFO line saying that the checks
run at its first training step instead. A randomized engine (``hutch``, ``hutchpp``) is not probed: its projections
draw from the run's DP generator.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeAlias

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from lightning_dp.checks.enclosing import UseTracker, enclosing_units
from lightning_dp.checks.probe_inputs import example_rows, probe_target
from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError
from lightning_dp.clipping.layers.registry import MisplacedParametersError

log = logging.getLogger("lightning_dp")

#: The most probes run at attach: each may find parameters to enclose (read outside their module's forward, first; then
#: layers on rows that are not examples), and the last confirms the enclosures.
_PROBES = 4


@contextmanager
def _restored(module: nn.Module) -> Iterator[None]:
    """Run in train mode, then restore the modules' modes, the buffers' values and the global RNGs (torch, numpy,
    ``random``)."""
    modes = {m: m.training for m in module.modules()}
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    devices = sorted({b.device.index or 0 for b in [*module.parameters(), *module.buffers()] if b.is_cuda})
    numpy_state, python_state = np.random.get_state(), random.getstate()  # noqa: NPY002 (the global state)
    with torch.random.fork_rng(devices=devices):
        module.train()
        try:
            yield
        finally:
            np.random.set_state(numpy_state)  # noqa: NPY002
            random.setstate(python_state)
            for m, training in modes.items():
                m.training = training
            with torch.no_grad():
                for name, value in module.named_buffers():
                    if name in buffers and value.shape == buffers[name].shape:
                        value.copy_(buffers[name])


def _call(module: nn.Module, inputs: Any) -> Any:
    device = next(module.parameters()).device
    inputs = dict(inputs) if isinstance(inputs, Mapping) else inputs
    moved = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, inputs)
    if isinstance(moved, Mapping):
        return module(**moved)
    if isinstance(moved, tuple):
        return module(*moved)
    return module(moved)


def _per_example_output(output: Any, rows: int) -> torch.Tensor | None:
    """The first floating tensor of ``output`` that requires grad and has ``rows`` rows (the logits of an HF head,
    the last hidden state of a bare model; a scalar auxiliary loss, router logits ``[B T, E]`` and a sequence-first
    tensor are passed over), or None."""
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_floating_point():
            if leaf.ndim > 0 and leaf.shape[0] == rows:
                return leaf
    return None


def _not_probed(why: str) -> bool:
    log.debug("attach probe skipped: %s", why)
    log.info(
        "The checks that need a forward (parameters read outside their module, layers applied to rows that are not "
        "examples, modules the exact fallback cannot rerun) run at the first training step, not at attach: to run "
        "them at attach, set `example_input_array` on the model (2 or more examples; a tensor, a tuple of positional "
        "or a dict of keyword inputs)"
    )
    return False


#: A context the probe's forward runs in: the training's autocast (``nullcontext`` for none).
ForwardContext: TypeAlias = Callable[[], AbstractContextManager[Any]]


class _NotProbed(Exception):
    """The model's example inputs cannot be probed (the reason is the message)."""


def _probe_once(
    called: nn.Module,
    inputs: Any,
    rows: int,
    clipper: PerSampleClipper,
    tracker: UseTracker,
    forward_context: ForwardContext,
) -> None:
    """One tracked forward of ``called`` (under ``forward_context()``) and its clip (:meth:`PerSampleClipper.probe`,
    outside it, as training clips).

    Raises:
        _NotProbed: the forward failed on the inputs, or returned no output with ``rows`` rows.
        MisplacedParametersError, UnsupportedModuleError: the clipper's refusal.
    """
    try:
        with tracker.tracking(), forward_context():
            output = _call(called, inputs)
    except UnsupportedModuleError:
        raise
    except Exception as error:  # inputs this model does not take (a multimodal model's HF dummy_inputs)
        clipper.discard_captures()
        raise _NotProbed(f"the model's example inputs failed ({type(error).__name__}: {error})") from error
    chosen = _per_example_output(output, rows)
    if chosen is None:
        clipper.discard_captures()
        raise _NotProbed(f"no floating output with {rows} rows requires grad")
    clipper.probe(chosen.float().tanh().flatten(1).sum(1))


def _unserved(
    misplaced: MisplacedParametersError, clipper: PerSampleClipper, error: Exception
) -> UnsupportedModuleError:
    """The first probe's refusal, with why the enclosures tried for it fail."""
    units = ", ".join(repr(unit or "<root>") for unit in clipper.enclosing)
    return UnsupportedModuleError(
        f"{misplaced}; the exact fallback on the smallest enclosing module that is per-sample ({units}) cannot serve "
        f"it either: {error}"
    )


def probe_at_attach(
    module: nn.Module,
    clipper: PerSampleClipper,
    forward_context: ForwardContext = nullcontext,
) -> bool:
    """Clip one forward of ``module`` on its example inputs, or of the HF model it wraps on that model's
    (:func:`~lightning_dp.checks.probe_inputs.probe_target`), the forward under ``forward_context()`` (the training's
    autocast), with ``clipper`` (:meth:`PerSampleClipper.probe`); the
    per-example loss ``[B]`` is ``sum tanh(output)`` of the first output tensor with ``B`` rows, ``B >= 2`` being the
    inputs' leading dimension. Inputs the model does not take skip the probe (logged at DEBUG); a model that cannot be
    probed is logged once at INFO.

    Parameters the hooks cannot attribute to examples where their module runs (read outside its forward, or used on
    rows that are not examples) are served by the exact fallback on the smallest enclosing module that is per-sample
    (:func:`~lightning_dp.checks.enclosing.enclosing_units`, :meth:`PerSampleClipper.enclose`), and the probe runs
    again to check it.

    Returns:
        Whether the probe ran (the model has example inputs it accepts, of two examples or more).

    Raises:
        UnsupportedModuleError: what the clipper refuses on that forward (BatchMixingError included), misplaced
            parameters with no enclosing module that is per-sample among them.
    """
    if clipper.sharded or clipper.engine.randomized:
        return False
    target = probe_target(module)
    if target is None:
        return _not_probed("the model has no example inputs")
    called, inputs = target
    rows = example_rows(inputs)
    if rows is None or rows < 2:
        return _not_probed(f"the example inputs have {rows or 'no'} rows, the probe needs 2 or more")
    tracker = UseTracker(module)
    misplaced: MisplacedParametersError | None = None  # the first probe's refusal, while enclosures are tried
    for _ in range(_PROBES):
        try:
            with _restored(module):
                _probe_once(called, inputs, rows, clipper, tracker, forward_context)
            return True
        except _NotProbed as error:
            if misplaced is None:
                return _not_probed(str(error))
            raise _unserved(misplaced, clipper, error) from error
        except MisplacedParametersError as error:
            units = enclosing_units(module, error, tracker, rows * clipper.augmentation_multiplicity, clipper.enclosing)
            if units is None or units == clipper.enclosing:
                raise
            misplaced = misplaced or error
            clipper.enclose(units)
        except UnsupportedModuleError as error:
            if misplaced is None:
                raise
            raise _unserved(misplaced, clipper, error) from error
    raise UnsupportedModuleError(
        f"the attach probe found parameters to serve by an enclosing module's fallback in each of {_PROBES} forwards "
        f"(enclosures so far: {clipper.enclosing}); freeze the parameters it names, or train the model with LoRA"
    )
