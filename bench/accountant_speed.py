"""Seconds per epsilon evaluation of each accountant at n = 1e8 parameters with 1000 orders.

Usage: ``python bench/accountant_speed.py [--num-params 1e8] [--orders 1000]``. Each accountant is timed on a
fresh event (no cache hit), then once more on the same event (the cached path calibration loops hit when only
``steps`` changes). The moments accountants (lap2, plrv and their paper modes) use integer orders 1..``orders``;
rdp/pld keep their own settings.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from lightning_dp.accounting import make_accountant
from lightning_dp.accounting.events import GaussianEvent, Lap2Event, LaplaceEvent, PlrvEvent, PoissonSampledEvent
from lightning_dp.accounting.moments import MomentsAccountant
from lightning_dp.utils.help_format import HelpFormatter


def _time(name: str, event: object, steps: int, orders: np.ndarray) -> tuple[float, float, float]:
    acc = make_accountant(name)
    if isinstance(acc, MomentsAccountant):
        acc.orders = orders
    start = time.perf_counter()
    eps = acc.compose(event, steps).get_epsilon(1e-5)
    first = time.perf_counter() - start
    start = time.perf_counter()
    acc.get_epsilon(1e-5)
    return eps, first, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--num-params", type=float, default=1e8)
    parser.add_argument("--orders", type=int, default=1000)
    args = parser.parse_args()
    logging.getLogger("lightning_dp").setLevel(logging.ERROR)  # silence the paper-mode warnings
    n, q, steps = int(args.num_params), 0.01, 1000
    orders = np.arange(1, args.orders + 1)
    cases = [
        ("basic", PoissonSampledEvent(q, LaplaceEvent(1e4, 1.0))),
        ("advanced", PoissonSampledEvent(q, Lap2Event(1.0, 1.0, n))),
        ("lap2", PoissonSampledEvent(q, Lap2Event(1.0, 1.0, n))),
        ("lap2-paper", PoissonSampledEvent(q, Lap2Event(1.0, 1.0, n))),
        ("plrv", PoissonSampledEvent(q, PlrvEvent(60000.0, 1e-5, 0.1, n))),
        ("plrv-paper", PoissonSampledEvent(q, PlrvEvent(60000.0, 1e-5, 0.1, n))),
        ("rdp", PoissonSampledEvent(q, GaussianEvent(1.0))),
        ("pld", PoissonSampledEvent(q, GaussianEvent(1.0))),
    ]
    print(f"n = {n:.0e} parameters, {args.orders} orders, q = {q}, {steps} steps, delta = 1e-5")
    print(f"{'accountant':<12} {'epsilon':>10} {'first call [s]':>15} {'cached [s]':>11}")
    for name, event in cases:
        eps, first, cached = _time(name, event, steps, orders)
        print(f"{name:<12} {eps:>10.4f} {first:>15.4f} {cached:>11.4f}")


if __name__ == "__main__":
    main()
