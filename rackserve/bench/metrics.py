"""Serving figures from per-request records: pure functions, no clocks, no I/O.

    summary = summarize(records, gpus=2, decode_gpus=1, price_per_gpu_hour=2.0)

A "GPU" is a rank of the deployment under test (a DP or expert rank, each on its own device); on a
CPU-only cluster each rank is a process standing for one GPU. `gpus` counts every rank (prefill and
decode), `decode_gpus` the ranks that decode (all of them when prefill and decode are colocated).

Definitions (times in seconds in, milliseconds out):
- duration: from the first request sent to the last token received;
- TTFT: first token received − request sent;
- TPOT: (last token − first token) / (output tokens − 1), for requests with ≥ 2 output tokens;
- per-user tokens/s: 1000 / TPOT ms. Its P50 is 1000 / TPOT P50, and its P90 is 1000 / TPOT P90:
  the speed that 90 % of requests get at least (higher per-user speed is better, so its tail is
  TPOT's upper tail);
- total tokens/s per GPU: (prompt tokens, cached ones included, + output tokens) / duration / gpus,
  as the public AgentX figures count them — a prefix-cache hit is served input;
- output tokens/s per decode GPU: output tokens / duration / decode_gpus;
- prefix-cache hit rate: cached prompt tokens / prompt tokens;
- goodput: requests per second of the run that met both a TTFT and a TPOT objective (a request with
  one output token meets any TPOT), and their share of the requests;
- $ per million tokens: what `gpus` GPUs cost for `duration` at `price_per_gpu_hour`, over the
  total (resp. output) tokens, in millions.
Percentiles interpolate linearly between order statistics (numpy's default; P50 is the median).
Failed requests are counted, and left out of every other figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A TPOT P50 under this (ms) means the median request's tokens reached the client in one delivery:
# the run measured how the stream was delivered, not a per-user decode speed.
BURST_TPOT_MS = 1.0


@dataclass(frozen=True)
class Record:
    """One request as a client saw it. Times (s) on one monotonic clock; token counts as the server
    reported them (`cached_tokens`: prompt tokens the prefix cache served)."""

    t_send: float
    t_first: float
    t_last: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_send

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; None with fewer than 2 output tokens."""
        return (self.t_last - self.t_first) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass(frozen=True)
class Summary:
    """The figures of one run (see the module docstring for each definition)."""

    requests: int
    failed: int
    duration_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    gpus: int
    decode_gpus: int
    total_tok_s_per_gpu: float
    output_tok_s_per_decode_gpu: float
    user_tok_s_p50: float
    user_tok_s_p90: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    cache_hit_rate: float
    usd_per_m_tokens: float | None
    usd_per_m_output_tokens: float | None


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 ≤ q ≤ 100) by linear interpolation; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def usd_per_m_tokens(tok_s_per_gpu: float, price_per_gpu_hour: float) -> float:
    """$ per million tokens of a GPU producing `tok_s_per_gpu` tokens/s at `price_per_gpu_hour`."""
    return price_per_gpu_hour / (tok_s_per_gpu * 3600) * 1e6 if tok_s_per_gpu > 0 else math.inf


def summarize(records: list[Record], gpus: int, decode_gpus: int,
              price_per_gpu_hour: float | None = None) -> Summary:
    """The run's figures over the successful `records`."""
    if gpus < 1 or not 1 <= decode_gpus <= gpus:
        raise ValueError(f"gpus={gpus}, decode_gpus={decode_gpus}: need 1 ≤ decode_gpus ≤ gpus")
    ok = [r for r in records if r.error is None]
    duration = max((r.t_last for r in ok), default=0.0) - min((r.t_send for r in ok), default=0.0)
    prompt, cached, output = (sum(getattr(r, k) for r in ok) for k in ("prompt_tokens", "cached_tokens",
                                                                       "output_tokens"))
    rate = 1 / duration if duration > 0 else 0.0  # per second of the run
    total_per_gpu = (prompt + output) * rate / gpus
    output_per_decode_gpu = output * rate / decode_gpus
    tpots = [r.tpot for r in ok if r.tpot is not None]
    ttfts = [r.ttft for r in ok]
    tpot_p50, tpot_p90 = percentile(tpots, 50), percentile(tpots, 90)
    price = price_per_gpu_hour
    return Summary(
        requests=len(records), failed=len(records) - len(ok), duration_s=duration,
        prompt_tokens=prompt, cached_tokens=cached, output_tokens=output, gpus=gpus, decode_gpus=decode_gpus,
        total_tok_s_per_gpu=total_per_gpu, output_tok_s_per_decode_gpu=output_per_decode_gpu,
        user_tok_s_p50=_per_user(tpot_p50), user_tok_s_p90=_per_user(tpot_p90),
        ttft_p50_ms=1e3 * percentile(ttfts, 50), ttft_p90_ms=1e3 * percentile(ttfts, 90),
        tpot_p50_ms=1e3 * tpot_p50, tpot_p90_ms=1e3 * tpot_p90,
        cache_hit_rate=cached / prompt if prompt else 0.0,
        usd_per_m_tokens=None if price is None else usd_per_m_tokens(total_per_gpu, price),
        # over every GPU, not the decode ones: the prefill GPUs are paid for too
        usd_per_m_output_tokens=None if price is None else usd_per_m_tokens(output * rate / gpus, price),
    )


def goodput(records: list[Record], ttft_ms: float, tpot_ms: float) -> tuple[float, float]:
    """(requests/s, share of all requests) of the `records` that succeeded within both objectives."""
    ok = [r for r in records if r.error is None]
    duration = max((r.t_last for r in ok), default=0.0) - min((r.t_send for r in ok), default=0.0)
    good = sum(1e3 * r.ttft <= ttft_ms and (r.tpot is None or 1e3 * r.tpot <= tpot_ms) for r in ok)
    return (good / duration if duration > 0 else 0.0), (good / len(records) if records else 0.0)


def _per_user(tpot_s: float) -> float:
    """Tokens/s one user sees at a TPOT of `tpot_s` seconds (1000 / TPOT ms)."""
    return 1.0 / tpot_s if tpot_s > 0 else math.nan
