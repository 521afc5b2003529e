"""The OpenAI-compatible HTTP endpoint: stateless FastAPI ingress replicas on Ray Serve in front of
one data plane.

    POST /v1/completions, /v1/chat/completions   (stream: server-sent events ending in [DONE])
    POST /tokenize, /detokenize                   (vLLM's shapes)
    GET  /v1/models, /health, /metrics

`build(settings)` is the Ray Serve application builder (`serve run deploy/tiny-cpu.yaml`,
`rackserve serve`): `num_ingress_replicas` replicas of `OpenAIServer`. The engines belong to the
app's data plane (`rackserve.serve.controller`, a detached actor the first replica creates and the
others attach to by name); each replica routes with its own `RequestRouter` and streams each request
straight from its decode rank (`DeploymentClient`), so the HTTP tier scales out, and a replica that
dies or is upgraded costs only its own streams, never the engines. Every failure a client can cause
is answered with an OpenAI-shaped 4xx and costs nobody else anything; more than `max_inflight`
requests in progress on a replica get 429 + Retry-After. A client that goes away mid-stream aborts
its request, which frees its state on every rank. An app told to drain (`rackserve.serve.drain`)
answers new generation requests, and /health, 503 + Retry-After while those in progress finish.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations at runtime.
# The helpers come before the deployment class: Ray Serve serialises the class when it is declared.

import asyncio
import hmac
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve

from rackserve.cluster.deployment_client import DeploymentClient
from rackserve.cluster.faults import InstanceError
from rackserve.cluster.request_router import RoutingConfig
from rackserve.engine import RequestOutput
from rackserve.engine.grammar import GrammarError, Grammars, GrammarSpec
from rackserve.models import BUILT_IN, family_of, read_config_json, resolve
from rackserve.models.reply import ReplyDelta, ReplyFormat, ReplyParser
from rackserve.models.tokenizer import ChatOptions, Tokenizer
from rackserve.serve import protocol as api
from rackserve.serve import responses
from rackserve.serve.config import ServeConfig
from rackserve.serve.controller import RemoteDataPlane, data_plane, shutdown_data_planes
from rackserve.serve.ingress import check_direct_ingress
from rackserve.serve.metrics import Metrics
from rackserve.timeouts import TIMEOUTS

logger = logging.getLogger("ray.serve")
EXTRA_ONGOING = 64  # Serve admits this many beyond max_inflight, so health and metrics get through
REPLICA_HEADER = "x-rackserve-replica"  # on generation responses: the ingress replica that answered
DRAINING, ENDED = "server_draining", "server_shutdown"  # error codes: refused while draining, ended at its timeout
ENDED_WHY = ("the server is shutting down and its drain timeout ran out before this request finished; retry it "
             "against another replica or later")

app = FastAPI(title="rackserve", docs_url=None, redoc_url=None, openapi_url=None)


class _Choice:
    """One choice's answer as it builds up: text (content), reasoning, tool calls, logprobs, finish reason,
    tokens generated. `parser` splits chat replies into those parts (None: all of it is content)."""

    def __init__(self, echo: str, parser: ReplyParser | None):
        self.text, self.reasoning, self.calls, self.logprobs, self.finish, self.tokens = "", "", [], [], None, 0
        self.streamed = 0  # logprobs sent in stream chunks so far
        self.echo = echo  # the prompt, sent with its first output (/v1/completions echo)
        self.parser = parser

    def take(self, new_text: str, finished: bool) -> ReplyDelta:
        """The reply's parts in `new_text` (the choice's last text when `finished`), added to the choice."""
        if self.parser is None:
            delta = ReplyDelta(content=self.echo + new_text)
        else:
            delta = self.parser.feed(new_text)
            if finished:
                delta = delta.then(self.parser.finish())
        self.echo = ""
        self.text += delta.content
        self.reasoning += delta.reasoning
        self.calls += [call for _, call in delta.tool_calls]
        return delta

    @property
    def finish_reason(self) -> str | None:
        """The engine's reason, or "tool_calls" for a reply that stopped after calling tools."""
        return "tool_calls" if self.calls and self.finish == "stop" else self.finish


class _Reply:
    """One request's answer as it builds up: per choice (`n`) text and logprobs, usage, timings.
    chat_reply: how a chat reply reads (`OpenAIServer._chat_prompt`), None for plain text."""

    def __init__(self, request_id: str, model: str, chat: bool, request, arrival: float, tokenizer,
                 chat_reply: tuple[ReplyFormat, bool] | None = None):
        self.id, self.model, self.chat, self.request, self.arrival = request_id, model, chat, request, arrival
        self.decode = (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if tokenizer else str
        self.label = responses.token_id_label if request.tokens_as_ids else self.decode  # a token in logprobs
        echo = ""
        if not chat and request.echo:
            echo = request.prompt if isinstance(request.prompt, str) else tokenizer.decode(list(request.prompt))

        def parser() -> ReplyParser | None:
            if chat_reply is None:
                return None
            fmt, reasoning = chat_reply
            return ReplyParser(fmt, reasoning=reasoning, tools=request.parses_tool_calls,
                               parallel=request.parallel_tool_calls)

        self.choices = [_Choice(echo, parser()) for _ in range(request.base_params.n)]
        self.error = None
        self.usage = responses.Usage(0, 0, 0)
        self.first_at = self.last_at = None

    @property
    def wants_logprobs(self) -> bool:
        return self.request.logprobs if self.chat else self.request.base_params.logprobs is not None

    def add(self, out: RequestOutput) -> list[dict]:
        """Take one engine output; the stream chunks to send for it (none, one, or a tool call's two)."""
        now = time.monotonic()
        self.first_at = self.first_at or now
        self.last_at = now
        if out.error:
            self.error = out.error
            return []
        choice = self.choices[out.index]
        delta = choice.take(out.new_text, out.finish_reason is not None)
        choice.logprobs += out.new_logprobs
        choice.finish, choice.tokens = out.finish_reason, out.num_output_tokens
        self.usage = responses.Usage(out.num_prompt_tokens, sum(c.tokens for c in self.choices), out.num_cached_tokens)
        finish = choice.finish_reason
        if not self.chat:
            if not (delta.content or finish):  # text held back (a character's first bytes): its logprobs wait too
                return []
            lp = responses.completion_logprobs(choice.logprobs[choice.streamed:], self.decode,
                                               len(choice.text) - len(delta.content), self.label) \
                if self.wants_logprobs else None
            choice.streamed = len(choice.logprobs)
            return [responses.completion_chunk(self.id, self.model, delta.content, finish, logprobs=lp,
                                               index=out.index)]
        lp = responses.chat_logprobs(out.new_logprobs, self.label) if self.wants_logprobs and out.new_logprobs \
            else None
        reasoning = delta.reasoning if self.request.include_reasoning else ""
        chunks = []
        if delta.content or reasoning or lp:
            chunks.append(responses.chat_chunk(self.id, self.model, delta.content or None, None, logprobs=lp,
                                               index=out.index, reasoning=reasoning or None))
        for at, call in delta.tool_calls:  # as OpenAI streams a call: its name first, then its arguments
            chunks += [responses.tool_call_chunk(self.id, self.model, out.index, at, call, name=True),
                       responses.tool_call_chunk(self.id, self.model, out.index, at, call, name=False)]
        if finish:
            chunks.append(responses.chat_chunk(self.id, self.model, None, finish, index=out.index))
        return chunks

    def response(self) -> dict:
        if self.chat:
            choices = [responses.chat_choice(c.text, c.finish_reason, responses.chat_logprobs(c.logprobs, self.label)
                                             if self.wants_logprobs else None, i,
                                             reasoning=c.reasoning if self.request.include_reasoning else "",
                                             tool_calls=c.calls) for i, c in enumerate(self.choices)]
            return responses.chat_response(self.id, self.model, choices, self.usage)
        choices = [responses.completion_choice(c.text, c.finish, responses.completion_logprobs(
            c.logprobs, self.decode, label=self.label) if self.wants_logprobs else None, i)
            for i, c in enumerate(self.choices)]
        return responses.completion_response(self.id, self.model, choices, self.usage)


async def _read_body(request: Request) -> bytes:
    """The body, refusing early (413) what is larger than the limit instead of reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > api.MAX_BODY_BYTES:
        raise api.APIError(413, f"the request body is {int(declared)} bytes; the limit is {api.MAX_BODY_BYTES}",
                           code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > api.MAX_BODY_BYTES:
            raise api.APIError(413, f"the request body exceeds the {api.MAX_BODY_BYTES}-byte limit",
                               code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _error(e: api.APIError) -> JSONResponse:
    headers = {"Retry-After": str(TIMEOUTS.retry_after_s)} if e.status == 429 or e.code in (DRAINING, ENDED) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


# a dead replica is noticed in seconds (Serve's defaults: checked every 10 s, 30 s to answer), so a
# replacement takes its streams' place fast; the check is only that the replica process answers
@serve.deployment(health_check_period_s=2.0, health_check_timeout_s=10.0)  # Ray options: `build`
@serve.ingress(app)
class OpenAIServer:
    def __init__(self, settings: dict):
        self.config = ServeConfig.from_dict(settings)
        if self.config.ingress == "direct":
            check_direct_ingress(self.config.port)
        self.plane = data_plane(self.config, serve.get_replica_context().app_name)  # waits until it is built
        info = ray.get(self.plane.info.remote())
        self.vocab_size, self.max_model_len = info.vocab_size, info.max_model_len
        # a built-in model is at home on every node (the tiny one made there)
        path = resolve(self.config.model) if self.config.model in BUILT_IN else info.path
        self.tokenizer = Tokenizer(path) if (Path(path) / "tokenizer.json").is_file() else None
        self.family = family_of(read_config_json(path)).model_type
        self.deployment = DeploymentClient(RemoteDataPlane(self.plane), self.tokenizer, name="ingress",
                                           routing=RoutingConfig.from_dict(self.config.routing))
        # compiles each request's grammar before it is routed, so one that cannot compile is a 400 before
        # anything runs (the rank compiles it again: a millisecond, then cached there too)
        self.grammars = Grammars(self.tokenizer.to_json(), self.vocab_size, self.tokenizer.eos_id) \
            if self.tokenizer is not None and self.tokenizer.eos_id is not None else None
        self.metrics = Metrics()
        self.inflight = 0
        self.replica = serve.get_replica_context().replica_id.unique_id
        # learnt before serving, so that a replica started during a drain admits nothing
        self.draining, self.ending = ray.get(self.plane.report.remote(self.replica, 0, False))
        # on the loop that runs the handlers (Serve runs the constructor there): see `_report_loop`
        self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    def __del__(self):  # Serve stops the replica: its pumps go; its requests' ranks abort what it left
        if hasattr(self, "deployment"):
            self.deployment.close()

    async def check_health(self) -> None:
        """Serve's health check of the replica: unhealthy once its data plane is dead (its engines died with
        it, and every request would fail), so that Serve replaces the replica and the new one builds the
        data plane again (`data_plane`: the named actor is gone). A data plane slow to answer is not dead."""
        try:
            await asyncio.wait_for(self.plane.info.remote(), TIMEOUTS.data_plane_check_s)
        except asyncio.TimeoutError:
            return
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"this replica's data plane is dead ({type(e).__name__}); Serve replaces the "
                               "replica, and the new one starts a new data plane") from None

    # ---- plain routes ------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        if self.draining:  # a load balancer takes the replica out before it stops
            return JSONResponse({"status": "draining", "healthy": False, "message": "the server is shutting "
                                 "down: it finishes the requests in progress and takes no new ones"},
                                status_code=503, headers={"Retry-After": str(TIMEOUTS.retry_after_s)})
        report = await self.plane.health.remote()
        return JSONResponse(report, status_code=200 if report["healthy"] else 503)

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        try:
            self._authorize(request)
        except api.APIError as e:
            return _error(e)
        # vLLM's card, and the model's family: what its chat encoding, reasoning and tool-call syntax follow
        card = {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "rackserve",
                "max_model_len": self.max_model_len, "family": self.family}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def prometheus(self) -> Response:
        self.metrics.observe_deployment(await self.plane.stats.remote())
        self.metrics.replays.set(self.deployment.replayed)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's /tokenize: the token ids of a text prompt, or of chat messages as the chat endpoint renders them."""
        try:
            self._authorize(request)
            req = api.parse_tokenize(api.parse_json(await _read_body(request)), [self.config.model_name])
            if req.messages is not None:
                ids, _ = self._chat_ids(req.messages, req.add_generation_prompt, req.add_special_tokens,
                                        req.chat_options)
            else:
                ids = self._text_tokenizer("prompt").encode(req.prompt, add_bos=req.add_special_tokens)
        except api.APIError as e:
            return _error(e)
        strs = [self.tokenizer.token_string(t) for t in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's /detokenize: the text of token ids, special tokens included."""
        try:
            self._authorize(request)
            ids = api.parse_detokenize(api.parse_json(await _read_body(request)), [self.config.model_name],
                                       self.vocab_size)
            text = self._text_tokenizer("tokens").decode(ids, skip_special_tokens=False)
        except api.APIError as e:
            return _error(e)
        return JSONResponse({"prompt": text})

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return self._signed(await self._generate(request, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return self._signed(await self._generate(request, chat=True))

    def _signed(self, response: Response) -> Response:
        """`response` with the header naming the replica that answered (which one took a request)."""
        response.headers[REPLICA_HEADER] = self.replica
        return response

    # ---- generation ----------------------------------------------------------------------------------
    async def _generate(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            self._authorize(request)
            body = api.parse_json(await _read_body(request))
            req = (api.parse_chat if chat else api.parse_completion)(body, [self.config.model_name])
            ids, chat_reply = self._chat_prompt(req) if chat else (self._prompt_ids(req), None)
            session = api.session_of(body, request.headers)
            params = req.sampling(len(ids), self.max_model_len, self.vocab_size)
            if chat:
                params = replace(params, structured=self._reply_grammar(req, params.structured, chat_reply))
            if params.structured is not None:
                self._check_grammar(params.structured, body)
            if self.draining:  # checked where the count goes up, with no await between: see `_report_loop`
                raise api.APIError(503, "the server is shutting down and takes no new requests; retry against "
                                        "another replica or later", "server_error", code=DRAINING)
            if self.inflight >= self.config.max_inflight:
                raise api.APIError(429, f"the server has {self.inflight} requests in progress, its limit; retry "
                                        f"in {TIMEOUTS.retry_after_s} s", "rate_limit_error", code="server_busy")
            self.inflight += 1
        except api.APIError as e:
            self.metrics.requests.labels(endpoint, e.status).inc()
            return _error(e)
        self.metrics.inflight.set(self.inflight)
        arrival = time.monotonic()
        try:
            request_id = await asyncio.to_thread(self.deployment.submit, ids, params, session)
        except (InstanceError, ValueError) as e:
            logger.warning("request refused: %s", e)
            self._done(endpoint, 503)
            return _error(api.APIError(503, f"the deployment could not take the request: {e}", "server_error"))
        if self.ending:  # routed while the replica ended its requests: its stream was opened after they were
            self.deployment.close(ENDED_WHY)
        reply = _Reply(api.new_request_id(chat), self.config.model_name, chat, req, arrival, self.tokenizer,
                       chat_reply)
        if req.stream:
            return StreamingResponse(self._events(request_id, reply, endpoint), media_type="text/event-stream")
        status = 200
        try:
            async for out in self.deployment.astream(request_id):
                reply.add(out)
        except InstanceError as e:
            status = 503
            return _error(self._lost(e))
        finally:
            self._done(endpoint, status, reply)
        if reply.error:
            self.metrics.requests.labels(endpoint, 400).inc()
            return _error(api.APIError(400, reply.error))
        return JSONResponse(reply.response())

    async def _events(self, request_id: str, reply: _Reply, endpoint: str):
        """The SSE body; closing it early (a client that went away) aborts the request."""
        outputs = self.deployment.astream(request_id)
        status = 200
        try:
            if reply.chat:
                for i in range(len(reply.choices)):
                    yield responses.sse(responses.chat_chunk(reply.id, reply.model, "", None, role=True, index=i))
            async for out in outputs:
                for chunk in reply.add(out):
                    yield responses.sse(chunk)
            if reply.error:
                yield responses.sse(api.APIError(400, reply.error).body())
            elif reply.request.include_usage:
                yield responses.sse(responses.usage_chunk(reply.id, reply.model, reply.usage, reply.chat))
            yield responses.SSE_DONE
        except InstanceError as e:
            status = 503
            yield responses.sse(self._lost(e).body())
            yield responses.SSE_DONE
        finally:
            await outputs.aclose()  # aborts the request if it is still running
            self._done(endpoint, status, reply)

    def _lost(self, e: InstanceError) -> api.APIError:
        """The error of a request its instance lost, or that the end of a drain ended."""
        return api.APIError(503, str(e), "server_error", code=ENDED if self.ending else None)

    async def _report_loop(self) -> None:
        """Every `TIMEOUTS.replica_report_s`: report the requests in progress to the data plane
        (`Controller.report`) and take from its answer whether to drain, and whether to end what runs; off
        every request's path.
        It runs on the handlers' event loop, where admission checks the flag and counts the request with
        no await between: a report sent while draining counts every request this replica has left to
        finish, and the drain waits for those (`rackserve.serve.drain`)."""
        while True:
            await asyncio.sleep(TIMEOUTS.replica_report_s)
            try:
                draining, ending = await self.plane.report.remote(self.replica, self.inflight, self.draining)
            except ray.exceptions.RayError:  # the data plane busy or gone (the app is being deleted)
                continue
            self.draining = draining
            if ending and not self.ending:
                self.ending = True
                self.deployment.close(ENDED_WHY)  # every open stream ends with an InstanceError saying why

    def _done(self, endpoint: str, status: int, reply: _Reply | None = None) -> None:
        self.inflight -= 1
        self.metrics.inflight.set(self.inflight)
        self.metrics.requests.labels(endpoint, status).inc()
        if reply is not None and reply.first_at is not None:
            m = self.metrics
            m.ttft.observe(reply.first_at - reply.arrival)
            longest = max(c.tokens for c in reply.choices)  # choices decode side by side
            if longest > 1:
                m.tpot.observe((reply.last_at - reply.first_at) / (longest - 1))
            m.prompt_tokens.inc(reply.usage.prompt_tokens)
            m.cached_tokens.inc(reply.usage.cached_tokens)
            m.output_tokens.inc(reply.usage.completion_tokens)

    def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise api.APIError(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                               "authentication_error", code="invalid_api_key")

    def _check_grammar(self, spec, body: dict) -> None:
        param = "tool_choice" if spec.kind == "tool_calls" else \
            "structured_outputs" if body.get("structured_outputs") is not None else "response_format"
        if self.grammars is None:
            raise api.APIError(400, "structured outputs need the model's tokenizer, which this checkpoint lacks",
                               param=param)
        try:
            self.grammars.matcher(spec)
        except GrammarError as e:
            raise api.APIError(400, str(e), param=param) from None

    def _text_tokenizer(self, param: str) -> Tokenizer:
        """The model's tokenizer, or a 400 on `param` saying this model has none."""
        if self.tokenizer is None:
            raise api.APIError(400, "this model has no tokenizer; send the prompt as token ids to /v1/completions",
                               param=param)
        return self.tokenizer

    def _chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, add_bos: bool = False,
                  options: ChatOptions | None = None) -> tuple[list[int], str]:
        """Chat messages as the model's prompt ids (its template or its family's encoder places BOS), and text."""
        tok = self._text_tokenizer("messages")
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt, options)
        except ValueError as e:
            raise api.APIError(400, str(e), param="messages") from None
        return tok.encode(text, add_bos=add_bos), text

    def _chat_prompt(self, req: api.ChatRequest) -> tuple[list[int], tuple[ReplyFormat, bool] | None]:
        """The prompt ids of a chat request, and how its reply reads: (the family's reply format, whether the
        reply starts inside reasoning), None for a family that marks neither."""
        ids, text = self._chat_ids(req.messages, options=req.chat_options)
        fmt = self.tokenizer.reply_format
        if fmt is None:
            return ids, None
        # the prompt opened the reasoning (DeepSeek's thinking mode), or closed it (chat mode; Qwen3 without
        # thinking); else the reply reasons first where the template taught the model to open it (Qwen3 in
        # thinking mode), and that opener, when it comes, is taken as the reasoning's own
        tail = text.rstrip()
        reasons = tail.endswith(fmt.think_start) or (
            not tail.endswith(fmt.think_end) and self.tokenizer.template_mentions(fmt.think_start))
        return ids, (fmt, reasons)

    def _reply_grammar(self, req: api.ChatRequest, spec: GrammarSpec | None,
                       chat_reply: tuple[ReplyFormat, bool] | None) -> GrammarSpec | None:
        """What a chat reply must follow: its response format, or the calls `tool_choice` forces, after the
        reasoning the model may write first."""
        forced = req.forced_tools
        if forced:
            if chat_reply is None:
                raise api.APIError(400, f"tool_choice {req.tool_choice!r} needs the model's tool-call syntax, and this "
                                        "model's family has none; send tool_choice \"auto\"", param="tool_choice")
            calls = {"syntax": chat_reply[0].name, "parallel": req.parallel_tool_calls,
                     "tools": [{"name": f["name"], "parameters": f.get("parameters") or {}} for f in forced]}
            spec = GrammarSpec("tool_calls", json.dumps(calls))
        if spec is None or chat_reply is None or not chat_reply[1]:
            return spec
        fmt = chat_reply[0]
        return replace(spec, reasoning=(fmt.think_start, fmt.think_end))

    def _prompt_ids(self, req: api.CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            self._text_tokenizer("prompt")
        elif req.echo and self.tokenizer is None:
            raise api.APIError(400, "echo gives the prompt back as text, which needs the model's tokenizer; this model "
                                    "has none: drop echo", param="echo")
        tok = self.tokenizer
        ids = tok.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise api.APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        return ids


def delete(app: str) -> None:
    """Delete Serve app `app` and stop its data plane, which outlives the app's replicas on purpose."""
    serve.delete(app)
    shutdown_data_planes(f"rackserve-{app}")


def build(settings: dict | None = None) -> serve.Application:
    """The Ray Serve application of a `ServeConfig` (its fields as a dict; defaults when empty)."""
    config = ServeConfig.from_dict(settings or {})
    # a replica that a redeploy replaces (or Serve stops) lets its requests finish for as long as a drain
    # does; Serve's own default, 20 s, cut the streams of a rolling upgrade
    return OpenAIServer.options(num_replicas=config.num_ingress_replicas,
                                ray_actor_options={"num_cpus": 0, "resources": dict(config.ingress_resources or {})},
                                max_ongoing_requests=config.max_inflight + EXTRA_ONGOING,
                                graceful_shutdown_timeout_s=config.drain_timeout_s).bind(config.to_dict())
