"""Gaussian accountants against independent references: dp-accounting directly, and Opacus's accountants."""

import logging

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from lightning_dp.accounting import GaussianEvent, PoissonSampledEvent, make_accountant
from lightning_dp.accounting.events import event_from_dict, event_to_dict

SIGMA, Q, STEPS, DELTA = 1.5, 0.04, 2250, 1e-5
EVENT = PoissonSampledEvent(Q, GaussianEvent(SIGMA))


def test_rdp_matches_dp_accounting_and_opacus():
    ours = make_accountant("rdp").compose(EVENT, STEPS).get_epsilon(DELTA)
    reference = rdp.RdpAccountant(orders=make_accountant("rdp").orders)
    reference.compose(dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA)), STEPS)
    assert ours == pytest.approx(reference.get_epsilon(DELTA), rel=1e-9)
    # Opacus RDPAccountant on the reference case reports 7.329; different order grids -> 1 %.
    assert ours == pytest.approx(7.329, rel=0.01)


def test_pld_matches_dp_accounting_and_opacus_prv():
    ours = make_accountant("pld").compose(EVENT, STEPS).get_epsilon(DELTA)
    reference = pld.PLDAccountant(value_discretization_interval=1e-4)
    reference.compose(dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA)), STEPS)
    assert ours == pytest.approx(reference.get_epsilon(DELTA), rel=1e-9)
    # Opacus PRVAccountant reports 6.777 with eps_error 0.01 (its stated tolerance).
    assert ours == pytest.approx(6.777, abs=0.02)


def test_opacus_accountants_live():
    opacus_accountants = pytest.importorskip("opacus.accountants")
    rdp_acc = opacus_accountants.RDPAccountant()
    rdp_acc.history = [(SIGMA, Q, STEPS)]
    ours = make_accountant("rdp").compose(EVENT, STEPS).get_epsilon(DELTA)
    assert ours == pytest.approx(rdp_acc.get_epsilon(DELTA), rel=0.01)
    prv = opacus_accountants.PRVAccountant()
    prv.history = [(SIGMA, Q, STEPS)]
    assert make_accountant("pld").compose(EVENT, STEPS).get_epsilon(DELTA) == pytest.approx(
        prv.get_epsilon(DELTA, eps_error=0.01), abs=0.03
    )


def test_pld_is_tighter_than_rdp():
    assert make_accountant("pld").compose(EVENT, 500).get_epsilon(DELTA) < make_accountant("rdp").compose(
        EVENT, 500
    ).get_epsilon(DELTA)


def test_ledger_merges_and_serialises():
    accountant = make_accountant("pld").compose(EVENT, 10).compose(EVENT, 5)
    assert accountant.ledger == [[EVENT, 15]] and accountant.steps == 15
    restored = make_accountant("pld")
    restored.load_state_dict(accountant.state_dict())
    assert restored.ledger == accountant.ledger
    assert event_from_dict(event_to_dict(EVENT)) == EVENT
    with pytest.raises(ValueError, match="saved by accountant"):
        make_accountant("rdp").load_state_dict(accountant.state_dict())


def test_mixed_ledger_composes_heterogeneous_steps():
    other = PoissonSampledEvent(Q, GaussianEvent(2.0))
    mixed = make_accountant("rdp").compose(EVENT, 100).compose(other, 100).get_epsilon(DELTA)
    lo = make_accountant("rdp").compose(other, 200).get_epsilon(DELTA)
    hi = make_accountant("rdp").compose(EVENT, 200).get_epsilon(DELTA)
    assert lo < mixed < hi


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0])
def test_bad_delta(delta):
    with pytest.raises(ValueError, match="delta"):
        make_accountant("pld").compose(EVENT, 1).get_epsilon(delta)


def test_unknown_accountant_and_unsupported_event():
    with pytest.raises(ValueError, match="Unknown accountant"):
        make_accountant("nope")
    with pytest.raises(ValueError, match="does not support"):
        make_accountant("pld").compose("not an event")


def test_empty_ledger_is_zero_and_noiseless_is_infinite():
    assert make_accountant("pld").get_epsilon(DELTA) == 0.0
    assert make_accountant("rdp").compose(GaussianEvent(0.0)).get_epsilon(DELTA) == float("inf")


def test_rdp_leaves_a_script_without_logging_set_up_so(monkeypatch):
    """absl's warning about an RDP order runs ``logging.basicConfig()``; the accountant removes that handler again."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    event = PoissonSampledEvent(0.101749, GaussianEvent(1.029309))  # an order whose series does not converge
    assert 0 < make_accountant("rdp").compose(event, 20).get_epsilon(1e-5) < 10
    assert root.handlers == []
    rdp.RdpAccountant().compose(dp_accounting.PoissonSampledDpEvent(0.101749, dp_accounting.GaussianDpEvent(1.029309)))
    assert root.handlers  # dp_accounting alone configures the root logger
