"""Validation of a model for per-sample clipping: which modules to hook, and which configurations to reject
(docs/design.md sections 4.6 and 9.1).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.nn.utils import parametrize

from lightning_dp.clipping.layers.fallback import FALLBACK, enclosing_family, fallback_problem, own_parameters
from lightning_dp.clipping.layers.registry import (
    LayerFamily,
    UnsupportedModuleError,
    find_layer_family,
    probed_family,
)
from lightning_dp.clipping.swaps.base import SwappedModule


def _shared_with_hooked_descendants(module: nn.Module, names: list[str]) -> bool:
    """Whether each parameter ``names`` of ``module`` is also registered in a hooked descendant (a proxy)."""
    covered = {
        id(p)
        for sub in module.modules()
        if sub is not module and find_layer_family(sub) is not None
        for p in sub.parameters(recurse=False)
    }
    return all(id(getattr(module, name)) in covered for name in names)


def hooked_modules(
    module: nn.Module, sharded: bool = False, enclosing: Mapping[str, tuple[str, ...]] | None = None
) -> dict[str, tuple[nn.Module, LayerFamily]]:
    """Validate ``module`` and return the modules to hook, ``{path: (module, family)}``. A module with trainable
    parameters and no registered family gets its parent type's family when its forward computes the parent's
    (:func:`~.layers.registry.probed_family`), else the exact fallback (:data:`~.layers.fallback.FALLBACK`). A module
    whose trainable parameters a hooked ancestor uses as its own (:func:`~.layers.fallback.own_parameters`: the LoRA
    factors of a peft ``ParamWrapper`` chain) is not hooked: the ancestor's terms cover them.

    Args:
        module: the model.
        sharded: whether it is FSDP2-sharded (:func:`~.layers.fallback.fallback_problem`).
        enclosing: ``{path: descendant paths relative to it}``: modules served by the exact fallback for their own
            parameters and those of the descendants named (:func:`~.layers.fallback.enclosing_family`), which are not
            hooked (found by the attach probe, :mod:`lightning_dp.checks.enclosing`).

    Raises:
        UnsupportedModuleError: BatchNorm anywhere; another norm layer with ``track_running_stats=True``; an
            ``nn.Embedding``/``nn.EmbeddingBag`` with ``max_norm`` anywhere (it renormalises its weight in place); a
            supported layer in a sample-mixing configuration; under FSDP2, a module the fallback cannot serve.
    """
    enclosing = dict(enclosing or {})
    enclosed = {f"{unit}.{sub}" if unit else sub for unit, subs in enclosing.items() for sub in subs}
    hooked: dict[str, tuple[nn.Module, LayerFamily]] = {}
    claimed: set[int] = set()  # ids of submodules' parameters a hooked module's call uses as its own
    for path, sub in module.named_modules():
        where = path or "<root>"
        if isinstance(sub, _BatchNorm):
            raise UnsupportedModuleError(
                f"module '{where}' ({type(sub).__name__}) mixes samples through batch statistics, so per-sample "
                "gradients are undefined under differential privacy; replace it with nn.GroupNorm (or nn.LayerNorm)"
            )
        if isinstance(sub, _NormBase) and sub.track_running_stats:
            raise UnsupportedModuleError(
                f"module '{where}' ({type(sub).__name__}) has track_running_stats=True: its running_mean/running_var "
                "buffers are updated from the training data without noise and saved in the state_dict, which "
                "leaks private data; set track_running_stats=False, or use nn.GroupNorm / nn.LayerNorm"
            )
        if isinstance(sub, nn.Embedding | nn.EmbeddingBag) and sub.max_norm is not None:
            raise UnsupportedModuleError(
                f"module '{where}' ({type(sub).__name__}) has max_norm={sub.max_norm}: its forward renormalises the "
                "looked-up rows of the weight in place, so the saved weights reveal which tokens were in training "
                "batches (without noise); set max_norm=None (per-sample clipping already bounds each update)"
            )
        if isinstance(sub, parametrize.ParametrizationList) or ".parametrizations." in f".{path}.":
            continue  # the originals are the parametrized module's (own_parameters), served by the fallback
        if path in enclosed:
            continue  # served by the fallback of the module enclosing it
        if path in enclosing:
            if sharded:
                raise UnsupportedModuleError(
                    f"module '{where}' ({type(sub).__name__}) would enclose parameters used outside their module's "
                    "forward, which the exact fallback cannot rerun on an FSDP2-sharded model; train it unsharded"
                )
            hooked[path] = (sub, enclosing_family(enclosing[path]))
            continue
        own = own_parameters(sub)
        trainable = [name for name, p in own.items() if p.requires_grad]
        if not trainable or all(id(own[name]) in claimed for name in trainable):
            continue  # none, or all used by a hooked ancestor's call as its own (a peft ParamWrapper's LoRA factors)
        # a parametrized module computes its weights from the originals: no family's maths, the fallback's
        family = None if parametrize.is_parametrized(sub) else find_layer_family(sub)
        if family is None and isinstance(sub, SwappedModule) and _shared_with_hooked_descendants(sub, trainable):
            continue  # its parameters are used through its proxy children (see swaps/base.py)
        if family is None:
            family = probed_family(sub)
        if family is None:
            family = FALLBACK
            problem = fallback_problem(sub, sharded)
        else:
            problem = family.check(sub) if family.check is not None else None
        if problem is not None:
            raise UnsupportedModuleError(f"module '{where}' ({type(sub).__name__}): {problem}")
        hooked[path] = (sub, family)
        claimed.update(id(p) for name, p in own.items() if "." in name)  # its submodules' (own_parameters)
    return hooked


def check_trainable_set(current: dict[object, str], known: dict[object, str]) -> None:
    """Raise when the trainable parameters differ from those at the clipper's construction (``current`` and ``known``
    map a parameter's ``id``, or its name when FSDP2-sharded, to its name).

    Raises:
        ValueError: naming the parameters whose status changed.
    """
    if current.keys() == known.keys():
        return
    frozen = [f"'{name}'" for key, name in known.items() if key not in current]
    unfrozen = [f"'{name}'" for key, name in current.items() if key not in known]
    changes = []
    if frozen:
        changes.append(f"no longer trainable (frozen or removed): {', '.join(frozen)}")
    if unfrozen:
        changes.append(f"newly trainable (unfrozen or added): {', '.join(unfrozen)}")
    raise ValueError(
        f"the set of trainable parameters changed after the PerSampleClipper was created; {'; '.join(changes)}. "
        "DP training needs the trainable set fixed before fit: freeze/unfreeze parameters before creating the "
        "trainer (not in a callback such as BackboneFinetuning), or create a new clipper after the change"
    )
