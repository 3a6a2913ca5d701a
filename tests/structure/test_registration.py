"""Every registry refuses to replace an entry silently (docs/design.md section 10): re-registering a name, layer type,
rule or swap that is taken raises ``ValueError`` unless ``override=True``, which replaces it and logs one warning
naming both; the same entry again is a no-op; ``remove`` removes an entry. Each test leaves the registries exactly
as it found them (the ``restore_registries`` fixture)."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from lightning_dp.accounting import ACCOUNTANTS, Accountant, register_accountant, register_event
from lightning_dp.accounting.events import _EVENT_TYPES, GaussianEvent
from lightning_dp.clipping import ENGINES, ClippingEngine, register_engine, register_layer, register_layer_rule
from lightning_dp.clipping.layers.linear import linear_terms
from lightning_dp.clipping.layers.norms import is_scale_only_rms_norm
from lightning_dp.clipping.layers.registry import _BY_RULE, _BY_TYPE, find_layer_family
from lightning_dp.clipping.swaps.base import _SWAPS, SwappedModule, register_swap
from lightning_dp.mechanisms import MECHANISMS, NoiseMechanism, make_mechanism, register_mechanism
from lightning_dp.mechanisms.gaussian import GaussianMechanism
from lightning_dp.registration import Registry, qualified_name

REGISTRIES: tuple[Registry[Any, Any], ...] = (
    MECHANISMS,
    ACCOUNTANTS,
    _EVENT_TYPES,
    ENGINES,
    _BY_TYPE,
    _BY_RULE,
    _SWAPS,
)


@pytest.fixture(autouse=True)
def restore_registries() -> Iterator[None]:
    """Put every registry back as it was (same entries, same order) after the test."""
    saved = [dict(registry) for registry in REGISTRIES]
    try:
        yield
    finally:
        for registry, entries in zip(REGISTRIES, saved, strict=True):
            dict.clear(registry)  # the registry's own writing methods refuse: restore through dict's
            dict.update(registry, entries)


# ============================================================================== one toy pair per registry


class ToyMechanism(NoiseMechanism):
    name = "toy-registration"


class OtherToyMechanism(NoiseMechanism):
    name = "toy-registration"


class FakeGaussian(NoiseMechanism):
    """A plugin's class that claims the built-in name."""

    name = "gaussian"
    default_accountant = "basic"


class ToyAccountant(Accountant):
    name = "toy-registration"


class OtherToyAccountant(Accountant):
    name = "toy-registration"


class FakeRdp(Accountant):
    name = "rdp"


@dataclasses.dataclass(frozen=True)
class ToyEvent:
    value: float


class Other:
    """Namespace giving classes of the same ``__name__`` other qualified names."""

    @dataclasses.dataclass(frozen=True)
    class ToyEvent:
        value: float

    @dataclasses.dataclass(frozen=True)
    class GaussianEvent:
        noise_multiplier: float


class ToyEngine(ClippingEngine):
    name = "toy-registration"


class OtherToyEngine(ClippingEngine):
    name = "toy-registration"


class FakeGhost(ClippingEngine):
    name = "ghost"


class ToyLayer(nn.Module):
    pass


def toy_terms(layer: nn.Module, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Any]:
    return {}


def other_toy_terms(layer: nn.Module, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Any]:
    return {}


def is_toy_layer(module: nn.Module) -> bool:
    return isinstance(module, ToyLayer)


class ToySwapped(SwappedModule):
    pass


class OtherToySwapped(SwappedModule):
    pass


@dataclasses.dataclass(frozen=True)
class Case:
    """One registry: how to register a value (a class, or a layer-terms function), the key it lands under, a toy pair
    under a fresh key, a built-in key and a value to claim it with."""

    id: str
    registry: Registry[Any, Any]
    register: Callable[..., object]  # (value, *, override)
    key: Any
    first: Any
    second: Any
    builtin_key: Any
    intruder: Any
    stored: Callable[[Any], Any] = lambda entry: entry  # the registered value as the registry holds it


CASES = [
    Case(
        "mechanism",
        MECHANISMS,
        lambda cls, *, override: register_mechanism(cls, override=override),
        "toy-registration",
        ToyMechanism,
        OtherToyMechanism,
        "gaussian",
        FakeGaussian,
    ),
    Case(
        "accountant",
        ACCOUNTANTS,
        lambda cls, *, override: register_accountant(cls, override=override),
        "toy-registration",
        ToyAccountant,
        OtherToyAccountant,
        "rdp",
        FakeRdp,
    ),
    Case(
        "event",
        _EVENT_TYPES,
        lambda cls, *, override: register_event(cls, override=override),
        "ToyEvent",
        ToyEvent,
        Other.ToyEvent,
        "GaussianEvent",
        Other.GaussianEvent,
    ),
    Case(
        "engine",
        ENGINES,
        lambda cls, *, override: register_engine(cls, override=override),
        "toy-registration",
        ToyEngine,
        OtherToyEngine,
        "ghost",
        FakeGhost,
    ),
    Case(
        "layer",
        _BY_TYPE,
        lambda fn, *, override, key=None: register_layer(key or ToyLayer, override=override)(fn),
        ToyLayer,
        toy_terms,
        other_toy_terms,
        nn.Linear,
        other_toy_terms,
        stored=lambda family: family.terms,
    ),
    Case(
        "layer-rule",
        _BY_RULE,
        lambda fn, *, override, key=None: register_layer_rule(key or is_toy_layer, override=override)(fn),
        qualified_name(is_toy_layer),
        toy_terms,
        other_toy_terms,
        qualified_name(is_scale_only_rms_norm),
        other_toy_terms,
        stored=lambda entry: entry[1].terms,
    ),
    Case(
        "swap",
        _SWAPS,
        lambda cls, *, override, key=None: register_swap(key or "tests.ToySwapTarget", override=override)(cls),
        "tests.ToySwapTarget",
        ToySwapped,
        OtherToySwapped,
        "torchvision.models.vision_transformer.Encoder",
        OtherToySwapped,
    ),
]


def register_builtin(case: Case, value: Any, *, override: bool) -> object:
    """Register ``value`` under the case's built-in key (the layer registries take the key apart from the value)."""
    if case.id == "layer":
        return case.register(value, override=override, key=nn.Linear)
    if case.id == "layer-rule":
        return case.register(value, override=override, key=is_scale_only_rms_norm)
    if case.id == "swap":
        return case.register(value, override=override, key=case.builtin_key)
    return case.register(value, override=override)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


# ============================================================================== every registry


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_a_taken_key_is_refused_without_override(case: Case) -> None:
    case.register(case.first, override=False)
    with pytest.raises(ValueError) as caught:
        case.register(case.second, override=False)
    message = str(caught.value)
    assert "\n" not in message and f"({qualified_name(case.first)})" in message, message
    assert re.search(r"is already registered \(.*\); pass override=True to replace it, or ", message), message
    assert case.stored(case.registry[case.key]) is case.first


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_a_builtin_entry_is_refused_without_override(case: Case) -> None:
    builtin = case.registry[case.builtin_key]
    with pytest.raises(ValueError, match="is already registered .*pass override=True"):
        register_builtin(case, case.intruder, override=False)
    assert case.registry[case.builtin_key] is builtin


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_override_replaces_and_warns_once_naming_both(case: Case, caplog: pytest.LogCaptureFixture) -> None:
    case.register(case.first, override=False)
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        case.register(case.second, override=True)
        case.register(case.second, override=True)  # the same entry again: nothing to replace, nothing to say
    assert case.stored(case.registry[case.key]) is case.second
    (warning,) = warnings_of(caplog)
    assert qualified_name(case.first) in warning and qualified_name(case.second) in warning


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_override_of_a_builtin_entry_warns(case: Case, caplog: pytest.LogCaptureFixture) -> None:
    old = case.stored(case.registry[case.builtin_key])
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        register_builtin(case, case.intruder, override=True)
    assert case.stored(case.registry[case.builtin_key]) is case.intruder
    (warning,) = warnings_of(caplog)
    assert qualified_name(old) in warning and qualified_name(case.intruder) in warning


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_the_same_entry_again_is_a_no_op(case: Case, caplog: pytest.LogCaptureFixture) -> None:
    case.register(case.first, override=False)
    with caplog.at_level(logging.DEBUG, logger="lightning_dp"):
        case.register(case.first, override=False)
    assert case.stored(case.registry[case.key]) is case.first and not caplog.records


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_remove_removes_and_registering_again_works(case: Case) -> None:
    before = list(case.registry)
    case.register(case.first, override=False)
    removed = case.registry.remove(case.key)
    assert case.stored(removed) is case.first and list(case.registry) == before
    with pytest.raises(KeyError, match="is not registered"):
        case.registry.remove(case.key)
    case.register(case.second, override=False)  # the key is free again
    assert case.stored(case.registry[case.key]) is case.second


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_the_registry_reads_as_a_plain_dict(case: Case) -> None:
    assert isinstance(case.registry, dict) and case.builtin_key in case.registry


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_get_returns_the_entry_or_default_and_names_lists_every_key(case: Case) -> None:
    assert case.registry.get(case.builtin_key) is case.registry[case.builtin_key]
    missing = "no-such-entry-registered"
    assert case.registry.get(missing, None) is None  # type: ignore[arg-type]
    names = case.registry.names()
    assert names == sorted(names) and len(names) == len(case.registry)
    label = qualified_name(case.builtin_key) if isinstance(case.builtin_key, type) else str(case.builtin_key)
    assert label in names


@pytest.mark.parametrize(
    ("registry", "misspelt", "message"),
    [
        (MECHANISMS, "gausian", "Unknown noise 'gausian' (did you mean 'gaussian'?); choose one of ["),
        (ACCOUNTANTS, "rpd", "Unknown accountant 'rpd' (did you mean 'rdp'?); choose one of ["),
        (ENGINES, "ghots", "Unknown clipping 'ghots' (did you mean 'ghost'?); choose one of ["),
        (_EVENT_TYPES, "GausianEvent", "Unknown privacy event 'GausianEvent' (did you mean 'GaussianEvent'?)"),
    ],
)
def test_get_of_an_unknown_name_suggests_the_closest_and_lists_all(
    registry: Registry[Any, Any], misspelt: str, message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        registry.get(misspelt)
    assert str(caught.value).startswith(message), caught.value
    assert all(repr(name) in str(caught.value) for name in registry.names())


# ============================================================================== specifics


def test_a_class_named_gaussian_is_refused_with_a_message_saying_what_to_change() -> None:
    expected = (
        "mechanism 'gaussian' is already registered (lightning_dp.mechanisms.gaussian.GaussianMechanism); "
        "pass override=True to replace it, or choose another name"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        register_mechanism(FakeGaussian)
    assert MECHANISMS["gaussian"] is GaussianMechanism
    assert isinstance(make_mechanism("gaussian", noise_multiplier=1.0, max_grad_norm=1.0), GaussianMechanism)


def test_a_class_named_gaussian_with_override_replaces_it_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):

        @register_mechanism(override=True)
        class Gaussian(FakeGaussian):
            pass

    assert MECHANISMS["gaussian"] is Gaussian
    (record,) = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert record.name == "lightning_dp"
    assert record.getMessage() == (
        "mechanism 'gaussian': lightning_dp.mechanisms.gaussian.GaussianMechanism replaced by "
        f"{qualified_name(Gaussian)} (override=True)"
    )


def test_the_decorators_work_bare_called_and_as_functions() -> None:
    @register_mechanism
    class Bare(NoiseMechanism):
        name = "toy-bare"

    @register_accountant()
    class Called(Accountant):
        name = "toy-called"

    class Replacement(NoiseMechanism):
        name = "toy-bare"

    assert register_mechanism(Replacement, override=True) is Replacement
    assert MECHANISMS["toy-bare"] is Replacement and ACCOUNTANTS["toy-called"] is Called
    assert Bare.name == "toy-bare"  # the bare decorator returns the class itself


def test_a_layer_registration_is_all_or_none() -> None:
    with pytest.raises(ValueError, match=re.escape(f"({qualified_name(linear_terms)})")):
        register_layer(ToyLayer, nn.Linear)(toy_terms)
    assert ToyLayer not in _BY_TYPE and _BY_TYPE[nn.Linear].terms is linear_terms


def test_an_overridden_rule_keeps_its_place_in_the_lookup_order() -> None:
    order = list(_BY_RULE)
    register_layer_rule(is_scale_only_rms_norm, override=True)(toy_terms)
    assert list(_BY_RULE) == order

    class ToyRMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

    family = find_layer_family(ToyRMSNorm())
    assert family is not None and family.terms is toy_terms


class ToySwapTarget(nn.Module):
    """A module class to swap, registered by class and by qualified name in the tests below."""


class ToySwappedTarget(ToySwapTarget, SwappedModule):
    pass


@pytest.mark.parametrize("first_by_name", [True, False], ids=["name-then-class", "class-then-name"])
def test_a_swap_keyed_the_other_way_is_refused_without_override(
    first_by_name: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A swap for a class and one for its qualified name would both match the same modules (the class's winning
    silently): the second is refused, and with ``override=True`` it replaces the first, which is unregistered."""
    name = qualified_name(ToySwapTarget)
    first, second = (name, ToySwapTarget) if first_by_name else (ToySwapTarget, name)
    swaps = {name: ToySwapped, ToySwapTarget: ToySwappedTarget}
    register_swap(first)(swaps[first])
    with pytest.raises(ValueError, match="is already registered for the same class .*pass override=True"):
        register_swap(second)(swaps[second])
    assert second not in _SWAPS
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        register_swap(second, override=True)(swaps[second])
    assert first not in _SWAPS and _SWAPS[second] is swaps[second]
    (warning,) = warnings_of(caplog)
    assert qualified_name(swaps[first]) in warning and qualified_name(swaps[second]) in warning


def test_a_randomized_engine_without_estimator_is_still_refused() -> None:
    class NoEstimator(ClippingEngine):
        name = "toy-no-estimator"
        randomized = True

    with pytest.raises(ValueError, match="must set estimator"):
        register_engine(NoEstimator)
    assert "toy-no-estimator" not in ENGINES


def test_the_shipped_entries_are_in_place() -> None:
    """The fixture put back what the overrides above replaced (file order runs this last)."""
    assert MECHANISMS["gaussian"] is GaussianMechanism and _EVENT_TYPES["GaussianEvent"] is GaussianEvent
    assert _BY_TYPE[nn.Linear].terms is linear_terms and "toy-registration" not in MECHANISMS


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda registry: registry.kind)
def test_the_dict_interface_cannot_write(registry: Registry[Any, Any]) -> None:
    """``ENGINES["flat"] = X`` and the dict's other writing methods would replace an entry without a word: they
    raise, and the registry is unchanged."""
    before = list(registry.items())
    key = next(iter(registry))
    writes = [
        lambda: registry.__setitem__(key, object()),
        lambda: registry.__delitem__(key),
        lambda: registry.update({key: object()}),
        lambda: registry.setdefault(object(), object()),
        lambda: registry.pop(key),
        lambda: registry.popitem(),
        lambda: registry.clear(),
    ]
    for write in writes:
        with pytest.raises(TypeError, match="read-only as a dict"):
            write()
    assert list(registry.items()) == before
