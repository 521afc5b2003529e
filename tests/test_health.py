"""`/health`'s verdict (`rackserve.serve.health`): which states are unhealthy, degraded or healthy,
and the P/D failure rates over the recent window, counters restarting with a gang included."""

from __future__ import annotations

from rackserve.serve.health import TransferCounts, TransferWindow, status
from rackserve.timeouts import TIMEOUTS

RATES_OK = {"push_failure_rate": 0.0, "recompute_rate": 0.0}


def test_no_decode_instance_serving_is_unhealthy_any_other_loss_degraded():
    ok = {"prefill0": "ok", "decode0": "ok"}
    assert status(ok, ["decode0"], 1, 1, RATES_OK) == ("healthy", [])
    verdict, why = status({**ok, "prefill0": "DP rank 0 died"}, ["decode0"], 1, 1, RATES_OK)
    assert verdict == "degraded" and why == ["prefill0: DP rank 0 died"]  # decode prefills meanwhile
    verdict, why = status({**ok, "decode0": "restarting"}, ["decode0"], 1, 1, RATES_OK)
    assert verdict == "unhealthy" and why == ["no decode instance is serving", "decode0: its gang is restarting"]
    verdict, why = status({**ok, "decode1": "down: no room"}, ["decode0", "decode1"], 1, 1, RATES_OK)
    assert verdict == "degraded" and why == ["decode1: down: no room"]
    verdict, why = status({**ok, "decode1": "restarting"}, ["decode0", "decode1"], 0, 1, RATES_OK)
    assert verdict == "degraded"
    assert why == ["decode1: its gang is restarting", "1 of 1 KV stores down (being replaced)"]


def test_failure_rates_cover_the_window_and_survive_counters_restarting():
    window = TransferWindow()
    window.add(TransferCounts(pushed=100, reserved=100), now=0.0)
    window.add(TransferCounts(pushed=190, push_failures=10, reserved=200, recomputed=10), now=10.0)
    rates = window.rates()
    assert rates == {"push_failure_rate": 0.1, "recompute_rate": 0.1}
    assert status({"d": "ok"}, ["d"], 1, 1, rates)[0] == "degraded"
    # a minute later with no failures since, the failures have left the window
    window_s = TIMEOUTS.health_window_s
    window.add(TransferCounts(pushed=300, push_failures=10, reserved=310, recomputed=10), now=10.0 + window_s)
    window.add(TransferCounts(pushed=320, push_failures=10, reserved=330, recomputed=10), now=20.0 + window_s)
    assert window.rates() == RATES_OK
    # a gang restarted: its counters began again, and the window with them
    window.add(TransferCounts(pushed=5, reserved=5), now=25.0 + window_s)
    assert window.rates() == RATES_OK
