"""A clipped forward at attach on the model's own example inputs (HF ``dummy_inputs``, Lightning
``example_input_array``), so that what only a forward shows is refused before training, not at its first step: a
parameter read outside its module's forward, a layer applied to rows that are not examples, a module the exact
fallback cannot rerun (docs/design.md section 9.1).

The inputs are the model's own (a Lightning ``example_input_array`` may be a real example: it is used like a batch
of the training data, nothing of it is released). The model's mode, buffers and the global RNG are restored; nothing
is written to ``.grad``. A randomized engine (``hutch``, ``hutchpp``) is not probed: its projections draw from the
run's DP generator.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from lightning_dp.checks.enclosing import UseTracker, enclosing_units
from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError
from lightning_dp.clipping.layers.registry import MisplacedParametersError

log = logging.getLogger("lightning_dp")

#: The most probes run at attach: each may find parameters to enclose (read outside their module's forward, first; then
#: layers on rows that are not examples), and the last confirms the enclosures.
_PROBES = 4


def example_inputs(module: nn.Module) -> Any:
    """The model's own example inputs: ``example_input_array`` (Lightning) or ``dummy_inputs`` (HF), or None."""
    for name in ("example_input_array", "dummy_inputs"):
        try:
            inputs = getattr(module, name, None)
        except Exception:  # a property that cannot build inputs for this model
            inputs = None
        if inputs is not None:
            return inputs
    return None


@contextmanager
def _restored(module: nn.Module) -> Iterator[None]:
    """Run in train mode, then restore the modules' modes, the buffers' values and the global RNG."""
    modes = {m: m.training for m in module.modules()}
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    devices = sorted({b.device.index or 0 for b in [*module.parameters(), *module.buffers()] if b.is_cuda})
    with torch.random.fork_rng(devices=devices):
        module.train()
        try:
            yield
        finally:
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


def probe_at_attach(module: nn.Module, clipper: PerSampleClipper) -> bool:
    """Clip one forward of ``module`` on its example inputs with ``clipper`` (:meth:`PerSampleClipper.probe`); the
    per-example loss is ``sum tanh(output)`` of the first output tensor. Inputs the model does not take are skipped.

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
    inputs = example_inputs(module)
    if inputs is None or clipper.sharded or clipper.engine.randomized:
        return False
    tracker = UseTracker(module)
    misplaced: MisplacedParametersError | None = None  # the first probe's refusal, while enclosures are tried
    for _ in range(_PROBES):
        with _restored(module):
            try:
                with tracker.tracking():
                    output = _call(module, inputs)
            except UnsupportedModuleError:
                raise
            except Exception as error:  # inputs this model does not take (a vision model's HF dummy_inputs)
                clipper.discard_captures()
                log.debug("attach probe skipped: the model's example inputs failed (%s)", error)
                return False
            first = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if first is None or first.ndim == 0 or first.shape[0] < 2 or not first.is_floating_point():
                clipper.discard_captures()
                return False
            try:
                clipper.probe(first.float().tanh().flatten(1).sum(1))
                return True
            except MisplacedParametersError as error:
                rows = first.shape[0] * clipper.augmentation_multiplicity
                enclosing = enclosing_units(module, error, tracker, rows, clipper.enclosing)
                if enclosing is None or enclosing == clipper.enclosing:
                    raise
                misplaced = misplaced or error
                clipper.enclose(enclosing)
            except UnsupportedModuleError as error:
                if misplaced is None:
                    raise
                raise UnsupportedModuleError(
                    f"{misplaced}; the exact fallback on the smallest enclosing module that is per-sample "
                    f"({', '.join(repr(unit or '<root>') for unit in clipper.enclosing)}) cannot serve it either: "
                    f"{error}"
                ) from error
    raise UnsupportedModuleError(
        f"the attach probe found parameters to serve by an enclosing module's fallback in each of {_PROBES} forwards "
        f"(enclosures so far: {clipper.enclosing}); freeze the parameters it names, or train the model with LoRA"
    )
