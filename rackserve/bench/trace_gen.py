"""Synthetic agentic traces in kv-cache-tester's format, drawn with the public traces' statistics.

    python -m rackserve.bench.trace_gen --out rackserve/bench/agentic_traces --traces 8 --subagent-share 0.25

`PUBLIC` are figures of the 710 coding-agent conversations in `callanjfox/kv-cache-tester`'s traces/
(Apache-2.0, commit 94f6046): per conversation its first request's input tokens and its number of
requests; per request after the first the input tokens not in the previous request's blocks (new
text: tool results, user messages, the previous answer), the output tokens and the think time
before it; the tool-definition and system-prompt tokens; and the sub-agents (17 of the 710 traces
spawn 63, of 5-17 requests starting from ~10K tokens of their own tools and prompt). Each
quantity is drawn from a log-normal with the published median and P90.

A synthetic trace keeps the format and its meaning: `hash_ids` name 64-token blocks, and a
request's blocks are the previous request's full blocks followed by new ones, so the cache hit rate
is what the statistics make it (~95 %). Its scope is "global": the tool and system blocks are
shared by every conversation (and every sub-agent shares the sub-agents' own), as they are between
one agent's conversations. Token counts are multiplied by `scale` (contexts of 10K-600K tokens do
not fit a CPU benchmark) and bounded by `max_context`; think times are kept as drawn (the replay
scales time).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from rackserve.bench import script

BLOCK = 64
# (median, P90) of the public traces, in tokens (think: seconds)
PUBLIC = {
    "start_tokens": (24_386, 258_855),
    "requests": (45, 155),
    "new_tokens": (705, 4_064),
    "out_tokens": (216, 899),
    "think_s": (10.0, 171.0),
    "subagent_requests": (11, 17),
    "subagent_start_tokens": (10_335, 11_763),
}
TOOL_TOKENS, SYSTEM_TOKENS = 12_262, 2_771  # medians
SUBAGENT_TOOL_TOKENS, SUBAGENT_SYSTEM_TOKENS = 8_306, 735
SUBAGENT_SHARE = 17 / 710  # of conversations spawning sub-agents
_Z90 = 1.2815515655446004  # the standard normal's 90th percentile
_SUBAGENT_IDS = 1 << 40  # the sub-agents' shared blocks are numbered from here, a conversation's from (i + 1) << 24


def lognormal(median: float, p90: float, rng: random.Random) -> float:
    """A draw from the log-normal with this median and 90th percentile."""
    return rng.lognormvariate(math.log(median), math.log(p90 / median) / _Z90)


def conversation(rng: random.Random, first_id: int, shared: tuple[int, ...], prefix_tokens: int, start: float,
                 requests: int, scale: float, max_context: int, t0: float = 0.0) -> list[dict]:
    """The requests of one conversation: its blocks numbered from `first_id` after the `shared`
    blocks (the tools and system prompt, `prefix_tokens` long), its first input about `start`
    tokens (unscaled, at most half of `max_context`: room to grow), at most `requests` requests and
    `max_context` input tokens each."""
    n_in = min(max_context // 2, max(prefix_tokens + BLOCK, round(start * scale)))
    ids, next_id, t, out = list(shared), first_id, t0, []
    for k in range(requests):
        if k:
            think = round(lognormal(*PUBLIC["think_s"], rng), 1)
            grown = n_in + out[-1]["out"] + max(1, round(lognormal(*PUBLIC["new_tokens"], rng) * scale))
            if grown > max_context:
                break
            ids, n_in, t = ids[: len(ids) - (n_in % BLOCK != 0)], grown, t + think  # a partial block is rewritten
        else:
            think = 0.0
        while len(ids) < -(-n_in // BLOCK):
            ids.append(next_id)
            next_id += 1
        out.append({"t": round(t, 1), "type": "s", "in": n_in,
                    "out": max(4, round(lognormal(*PUBLIC["out_tokens"], rng) * scale)),
                    "hash_ids": list(ids), "input_types": ["text" if k == 0 else "tool_result"],
                    "think_time": think, "api_time": 0.0})
    return out


def trace(index: int, seed: int, scale: float, max_requests: int, max_context: int,
          subagent_share: float = SUBAGENT_SHARE) -> dict:
    """Conversation `index` of a synthetic set (drawn from `seed` and `index` alone)."""
    rng = random.Random(f"{seed}/{index}")
    tools, system = round(TOOL_TOKENS * scale), round(SYSTEM_TOKENS * scale)
    shared = tuple(range(1, (tools + system) // BLOCK + 1))
    requests = min(max_requests, max(2, round(lognormal(*PUBLIC["requests"], rng))))
    conv = conversation(rng, (index + 1) << 24, shared, tools + system, lognormal(*PUBLIC["start_tokens"], rng),
                        requests, scale, max_context)
    if len(conv) > 1 and rng.random() < subagent_share:
        at = rng.randrange(1, len(conv))  # spawned after a request; the parent waits for them
        sub_tools, sub_system = round(SUBAGENT_TOOL_TOKENS * scale), round(SUBAGENT_SYSTEM_TOKENS * scale)
        sub_shared = tuple(range(_SUBAGENT_IDS, _SUBAGENT_IDS + (sub_tools + sub_system) // BLOCK))
        markers = []
        for a in range(rng.choice((1, 2))):
            n = min(max_requests, max(2, round(lognormal(*PUBLIC["subagent_requests"], rng))))
            first = ((index + 1) << 24) + ((a + 1) << 20)
            reqs = conversation(rng, first, sub_shared, sub_tools + sub_system,
                                lognormal(*PUBLIC["subagent_start_tokens"], rng), n, scale, max_context)
            markers.append({"t": conv[at - 1]["t"], "type": "subagent", "agent_id": f"agent_{a + 1:03d}",
                            "tool_tokens": sub_tools, "system_tokens": sub_system, "requests": reqs})
        conv[at:at] = markers
    return {"id": f"synthetic_{seed}_{index:04d}", "models": ["synthetic"], "block_size": BLOCK,
            "hash_id_scope": "global", "tool_tokens": tools, "system_tokens": system, "requests": conv}


def write(out: str | Path, traces: int, seed: int = 0, scale: float = 1 / 32, max_requests: int = 12,
          max_context: int = 3072, subagent_share: float = SUBAGENT_SHARE) -> list[Path]:
    """`traces` synthetic traces as JSON files in `out` (one per conversation, as the public set)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(traces):
        doc = trace(i, seed, scale, max_requests, max_context, subagent_share)
        path = out / f"{doc['id']}.json"
        path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> dict:
    ap = script.parser(__doc__)
    ap.add_argument("--out", required=True, help="directory to write the traces to")
    ap.add_argument("--traces", type=int, default=8, help="conversations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1 / 32, help="token counts x this")
    ap.add_argument("--max-requests", type=int, default=12, help="requests per conversation at most")
    ap.add_argument("--max-context", type=int, default=3072, help="input tokens per request at most")
    ap.add_argument("--subagent-share", type=float, default=SUBAGENT_SHARE,
                    help="share of conversations that spawn sub-agents (the public traces': 17/710)")
    args = ap.parse_args(argv)
    paths = write(args.out, args.traces, args.seed, args.scale, args.max_requests, args.max_context,
                  args.subagent_share)
    docs = [json.loads(p.read_text()) for p in paths]

    def flatten(requests: list[dict]) -> list[dict]:
        return [x for r in requests for x in (flatten(r["requests"]) if r["type"] == "subagent" else [r])]

    flat = [r for d in docs for r in flatten(d["requests"])]
    print(f"wrote {len(paths)} traces to {args.out}: {len(flat)} requests, "
          f"{sum(r['type'] == 'subagent' for d in docs for r in d['requests'])} sub-agents, "
          f"input tokens {min(r['in'] for r in flat)}-{max(r['in'] for r in flat)}")
    return script.headline({"bench": "trace_gen", "out": str(args.out), "traces": len(paths), "requests": len(flat)})


if __name__ == "__main__":
    main()
