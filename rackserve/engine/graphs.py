"""Decode forwards on a few fixed shapes, each compiled or captured once and replayed every step.

A decode pass (every request runs its last token, and its drafts when speculating) is padded to a
bucket of token rows (`EngineConfig.graph_buckets`) and a power-of-two number of pages, with
padding requests on the engine's scratch request, so a handful of shapes covers every step. The
model family builds the batch with that shape (`ServingModel.build_batch(static=…)`); it is copied
into the shape's own buffers, and the shape's forward runs:
- `compile="on"` on CUDA: a CUDA graph of the eager forward, captured at the shape's first use
  (launch overhead gone; the kernels are the Triton ones of `rackserve.kernels`);
- `compile="on"` elsewhere: `torch.compile` (inductor) with `fullgraph=True`, so a graph break is
  an error, not a silent slowdown; inductor caches the generated code on disk
  (`TORCHINDUCTOR_CACHE_DIR`), so a restart pays tracing only;
- `compile="trace"`: dynamo traces the forward into one graph and runs it op by op without code
  generation: checks in seconds that the forward is capture-safe (tests, debugging).
A DP rank of an expert-parallel gang (`lockstep`) exchanges tokens with its peers at every MoE
layer, driven by the host; the compiled graph calls each exchange as one opaque op
(`rackserve::expert_parallel`), so it stays one graph, and is compiled on CUDA too: a CUDA graph
cannot hold a host-driven exchange. A shape that fails to compile or capture runs eager from then
on, with a warning naming the cause; passes that are not decode (prefill chunks) and those larger
than the largest bucket run eager.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import fields, is_dataclass

import torch

from rackserve.models.interface import BatchRequest, ServingModel, StaticShape
from rackserve.models.state import PagedState, RequestState

log = logging.getLogger(__name__)
_compiled = 0  # shapes compiled in this process, by every engine


@functools.cache
def _dynamo_defaults() -> tuple[int, int]:
    """dynamo's recompile limits as it sets them, read at the process's first compile, before we raise them
    (dynamo is imported there: importing it costs a process 1.3 s, paid only where something compiles)."""
    config = torch._dynamo.config
    return config.recompile_limit, config.accumulated_recompile_limit


def _leaves(x) -> list[torch.Tensor]:
    """The tensors of a batch (dataclasses, dicts, lists of tensors), in a fixed order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if is_dataclass(x):
        return [t for f in fields(x) for t in _leaves(getattr(x, f.name))]
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in _leaves(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _leaves(v)]
    return []


class _Shape:
    """One shape's buffers (inputs whose tensors are overwritten each call) and its runnable."""

    def __init__(self, inputs: tuple):
        self.inputs = inputs
        self.buffers = _leaves(inputs)
        self.run = None  # () -> outputs; None: eager (compiling or capturing failed)


class DecodeGraphs:
    """The compiled or captured decode forwards of one engine: per function of the model that runs on
    fixed shapes (`static_forward`, and the draft layer's) and per `StaticShape`."""

    def __init__(self, model: ServingModel, state: PagedState, scratch: RequestState, mode: str,
                 buckets: Sequence[int], max_pages: int, max_new_tokens: int, lockstep: bool = False):
        """mode: "on" or "trace" (`EngineConfig.compile`); buckets: token counts a pass is padded to;
        max_pages: the most pages a request can hold; max_new_tokens: the most tokens a request runs
        in a decode pass (1 + speculative tokens); lockstep: a DP rank of an expert-parallel gang."""
        self.model, self.state, self.scratch, self.mode = model, state, scratch, mode
        self.buckets, self.max_new_tokens = sorted(buckets), max_new_tokens
        self.page_buckets = [1 << i for i in range(max(1, max_pages - 1).bit_length())] + [max_pages]
        self.page_buckets = sorted({p for p in self.page_buckets if p <= max_pages})
        self.cuda = model.device.type == "cuda" and not lockstep  # capture CUDA graphs
        self.shapes: dict[tuple[str, StaticShape], _Shape] = {}  # by (function, shape)
        self.replays = 0  # calls run on a fixed shape
        self.failures = 0  # shapes that failed to compile or capture (they run eager)
        self._pool = torch.cuda.graph_pool_handle() if self.cuda else None

    def shape_for(self, requests: Sequence[BatchRequest]) -> StaticShape | None:
        """The fixed shape a pass over `requests` runs on, or None when it runs eager (a prefill chunk
        in it, or more tokens than the largest bucket)."""
        if any(len(ids) > self.max_new_tokens for _, ids in requests):
            return None
        tokens = sum(len(ids) for _, ids in requests)
        pages = max(len(h.pages) for h, _ in requests)
        bucket = next((b for b in self.buckets if b >= tokens), None)
        page_bucket = next((p for p in self.page_buckets if p >= pages), None)
        if bucket is None or page_bucket is None:
            return None
        return StaticShape(bucket, page_bucket)

    def forward(self, shape: StaticShape, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's forward of `batch` (built with `static=shape`) -> (logits `[shape.tokens, vocab]`,
        streams `[shape.tokens, …]`); rows past the real ones are padding."""
        return self.run(self.model.static_forward, shape, batch)

    def run(self, fn: Callable, shape: StaticShape, *inputs):
        """`fn(*inputs, state)` on fixed shapes: `fn` is one of the model's capture-safe functions, its
        batch among `inputs` built with `static=shape` and its other tensors padded to `shape.tokens`
        rows. The outputs of a captured graph are its own buffers: read them before the next call."""
        key = (fn.__name__, shape)
        entry = self.shapes.get(key)
        first = entry is None
        if first:
            entry = self.shapes[key] = self._prepare(key, fn, inputs)
        else:
            for dst, src in zip(entry.buffers, _leaves(inputs), strict=True):
                dst.copy_(src, non_blocking=True)
        self.replays += 1
        with torch.no_grad():
            # torch.compile compiles the whole graph at the first call, before it runs anything (a
            # gang's exchanges included), so a failure can be retried eagerly
            if entry.run is not None and first and not self.cuda:
                try:
                    return entry.run()
                except Exception as e:  # noqa: BLE001 - a shape that cannot compile runs eager
                    self._failed(key, e)
                    entry.run = None
            if entry.run is None:
                return fn(*entry.inputs, self.state)
            return entry.run()

    def _prepare(self, key: tuple[str, StaticShape], fn: Callable, inputs: tuple) -> _Shape:
        """A new shape's buffers (holding `inputs`) and its compiled or captured function."""
        try:
            with torch.no_grad():
                if self.cuda:
                    # captured on padding only: the warm-up run writes only the scratch request's rows
                    # (a verify pass run twice would overwrite window rows it reads)
                    idle = self.model.build_batch(self.state, [], static=key[1], scratch=self.scratch)
                    entry = _Shape(tuple(x.new_zeros(x.shape) if isinstance(x, torch.Tensor) else idle
                                         for x in inputs))
                    entry.run = self._capture(fn, entry.inputs)
                    for dst, src in zip(entry.buffers, _leaves(inputs), strict=True):
                        dst.copy_(src)
                else:
                    entry = _Shape(inputs)
                    entry.run = self._compile(fn, entry.inputs)
            return entry
        except Exception as e:  # noqa: BLE001 - any failure leaves this shape eager, never the engine down
            self._failed(key, e)
            return _Shape(inputs)

    def _failed(self, key: tuple[str, StaticShape], e: Exception) -> None:
        self.failures += 1
        log.warning("%s on %s runs eager: %s failed (%s: %s)", *key,
                    "CUDA graph capture" if self.cuda else "torch.compile", type(e).__name__, e)

    def _compile(self, fn: Callable, inputs: tuple):
        # every shape is one more specialisation of `fn`, beside those every engine of the process made
        # before: let dynamo keep them all. Its settings are per thread: this is the one that compiles.
        global _compiled
        _compiled += 1
        recompiles, accumulated = _dynamo_defaults()
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, recompiles + _compiled)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, accumulated + _compiled)
        compiled = torch.compile(fn, fullgraph=True, dynamic=False,
                                 backend="eager" if self.mode == "trace" else "inductor")
        return lambda: compiled(*inputs, self.state)

    def _capture(self, fn: Callable, inputs: tuple):
        # warm-up outside the capture: Triton compiles its kernels here
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*inputs, self.state)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn(*inputs, self.state)

        def run():
            graph.replay()
            return out
        return run
