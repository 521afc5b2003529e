"""What structured outputs cost: a batch with 0 %, 50 % and 100 % of its requests following JSON schemas,
against the same batch unconstrained.

    python -m rackserve.bench.structured [--batches 1,8,32] [--tokens 64] [--repeats 3]

The built-in `tiny-code` model (4,096 ids), one engine per scheduling mode. For each batch size B and
constrained share: B requests with held-out code prompts, the constrained ones following assorted JSON
schemas (`assorted_schemas`: nested objects, arrays, enums, bounded numbers), sampled at
temperature 0.8, at most --tokens output tokens (EOS ignored by the unconstrained ones; a constrained
one ends with its JSON, which must parse). Reported per run (median of --repeats): ms per engine step, output tokens/s,
and the grammar's share of a step (`phase("grammar")`: filling the constrained rows' bitmasks on the
host, each after the drafts before it, and masking the logits), as ms per step and per constrained
row. Synchronous and async scheduling: async, a constrained request sits out the step in which its
last token is still pending (its next mask needs it), so it decodes every other step — the cost of
that choice is the async rows' tokens/s against the synchronous ones'.

There is no physical limit to compare with; the reference is the same batch unconstrained (0 %).
The machine may be shared and noisy: read the ratios. The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import time

from rackserve import timing
from rackserve.bench import script
from rackserve.engine import LLM, SamplingParams
from rackserve.engine.grammar import GrammarSpec
from rackserve.models.code_corpus import held_out_prompts

SHARES = (0.0, 0.5, 1.0)
# assorted JSON schemas (the tests' too), each output bounded: strings have a maxLength, arrays a maxItems
# (numbers may run on in digits: a model ends them)
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["cpu", "gpu", "tpu"]}},
     "required": ["ok", "kind"], "additionalProperties": False},
    {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer", "minimum": 1,
     "maximum": 9}, "minItems": 1, "maxItems": 4}}, "required": ["ids"], "additionalProperties": False},
    {"type": "object", "properties": {"rack": {"type": "object", "properties": {"trays": {"type": "integer",
     "minimum": 1, "maximum": 18}, "load": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["trays", "load"], "additionalProperties": False}}, "required": ["rack"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5,
     "maximum": 5}}, "required": ["x"], "additionalProperties": False}, "minItems": 1, "maxItems": 3},
]


def assorted_schemas(n: int) -> list[dict]:
    """`n` JSON schemas: SCHEMAS, then objects (additionalProperties false) holding one of them and a
    field of another kind: a bounded integer, an enum, an array, a string, a nested object."""
    out = []
    for i in range(n):
        base = SCHEMAS[i % len(SCHEMAS)]
        if i < len(SCHEMAS):
            out.append(base)
            continue
        k = i // len(SCHEMAS)
        extra = [{"type": "integer", "minimum": -k, "maximum": 10 * k},
                 {"enum": [f"v{j}" for j in range(k + 1)]},
                 {"type": "array", "items": {"type": "boolean"}, "maxItems": k % 4 + 1},
                 {"type": "string", "maxLength": k + 2},
                 {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": k}},
                  "required": ["n"], "additionalProperties": False}][i % 5]
        out.append({"type": "object", "properties": {"item": base, f"f{k}": extra}, "required": ["item", f"f{k}"],
                    "additionalProperties": False})
    return out


def run(llm: LLM, batch: int, share: float, tokens: int, seed: int) -> dict:
    """One batch to completion: ms per step, output tokens/s, grammar ms per step and per constrained row."""
    constrained = round(batch * share)
    prompts, params, schemas = held_out_prompts(batch), [], assorted_schemas(batch)
    for i in range(batch):
        common = dict(temperature=0.8, seed=seed * 1000 + i, max_tokens=tokens)
        if i < constrained:
            spec = GrammarSpec("json_schema", json.dumps(schemas[i]))
            params.append(SamplingParams(structured=spec, **common))
        else:
            params.append(SamplingParams(ignore_eos=True, **common))
    steps = llm.engine.num_steps
    timing.reset()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    steps = llm.engine.num_steps - steps
    grammar = timing.totals().get("grammar", 0.0)
    rows = sum(len(o.token_ids) for o in outs[:constrained])  # constrained rows sampled, one per token
    bad = [o.text for o in outs[:constrained] if o.finish_reason == "stop" and not _parses(o.text)]
    if bad:
        raise RuntimeError(f"structured outputs that do not parse: {bad[:2]}")
    return {"step_ms": 1e3 * wall / steps, "tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
            "grammar_ms_per_step": 1e3 * grammar / steps, "grammar_us_per_row": 1e6 * grammar / rows if rows else 0.0}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def measure(batches: list[int], tokens: int, repeats: int) -> list[dict]:
    rows = []
    timing.enable()
    try:
        for mode, kwargs in (("sync", {}), ("async", {"async_scheduling": True})):
            llm = LLM("tiny-code", max_num_seqs=max(batches), max_num_batched_tokens=max(512, 2 * max(batches)),
                      **kwargs)
            run(llm, max(batches), 0.5, 8, seed=0)  # warm: first compiles and allocations
            for batch in batches:
                for share in SHARES:
                    runs = [run(llm, batch, share, tokens, seed=r + 1) for r in range(repeats)]
                    rows.append({"mode": mode, "batch": batch, "share": share,
                                 **{k: statistics.median(r[k] for r in runs) for k in runs[0]}})
    finally:
        timing.enable(False)
    return rows


def table(rows: list[dict]) -> str:
    base = {(r["mode"], r["batch"]): r for r in rows if r["share"] == 0.0}
    lines = ["| mode | batch | constrained | ms/step | × unconstrained | tokens/s | grammar ms/step | "
             "grammar µs/row |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = base[(r["mode"], r["batch"])]
        lines.append(f"| {r['mode']} | {r['batch']} | {r['share']:.0%} | {r['step_ms']:.2f} | "
                     f"{r['step_ms'] / ref['step_ms']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['grammar_ms_per_step']:.3f} | {r['grammar_us_per_row']:.1f} |")
    return "\n".join(lines)


def figures(rows: list[dict]) -> dict:
    out = {"bench": "structured"}
    base = {(r["mode"], r["batch"]): r for r in rows if r["share"] == 0.0}
    for r in rows:
        key = f"{r['mode']}_b{r['batch']}_{round(100 * r['share'])}"
        out[f"step_ratio_{key}"] = round(r["step_ms"] / base[(r["mode"], r["batch"])]["step_ms"], 3)
        out[f"grammar_us_per_row_{key}"] = round(r["grammar_us_per_row"], 1)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = script.parser(__doc__)
    ap.add_argument("--batches", type=script.int_list, default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64, help="most output tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    rows = measure(args.batches, args.tokens, args.repeats)
    print("tiny-code (4,096 ids) on this machine's CPU, sampled at 0.8; 'grammar': masks filled and applied\n")
    print(table(rows))
    return script.headline(figures(rows))


if __name__ == "__main__":
    main()
