"""The HTTP application: OpenAI's chat and text completion endpoints (as llama.cpp's server
gives them, with its ``timings``), the model list, health and Prometheus metrics, over one
engine through a :class:`~specgguf.server.scheduler.Scheduler`.

A request is checked (types and ranges by pydantic, unsupported features by name), its
prompt rendered and tokenized and checked against the context, its constraint on the output
(a JSON Schema, a grammar, forced tool calls) compiled, before it is queued; so every bad
request is a 4xx with OpenAI's error shape before any generation starts. A chat answer
with tool calls (:mod:`specgguf.server.tools`) comes back as ``message.tool_calls`` or, streamed,
as ``delta.tool_calls`` chunks at the end, with ``finish_reason`` ``"tool_calls"``. A
response streams as server-sent events (``fastapi.sse``'s framing) or comes whole; either
way, a client that goes away cancels its generation (:meth:`Job.cancel`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specgguf import __version__
from specgguf.errors import (
    BackendError,
    ChatInputError,
    ChatTemplateError,
    ContextOverflowError,
    GrammarError,
    SpecggufError,
    ToolsTemplateError,
)
from specgguf.server.errors import (
    APIError,
    bad_request,
    install_handlers,
    refused,
    validation_error,
)
from specgguf.server.metrics import Metrics
from specgguf.server.scheduler import Job, QueueFull, Scheduler, ShuttingDown
from specgguf.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    _Generation,
    check_supported,
    constraint,
)
from specgguf.server.tools import (
    ParsedMessage,
    ToolCallStream,
    ToolSet,
    output_constraint,
    parameters_schema,
    parse_tool_calls,
)
from specgguf.speculative.grammar import GrammarSpec
from specgguf.speculative.loop import GenerationParams, GenerationResult, GenerationStats
from specgguf.speculative.sampling import SamplerParams

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from specgguf.engine import Engine, Prompt

log = logging.getLogger("specgguf.server")
R = TypeVar("R", bound=BaseModel)

#: Seconds a client is told to wait before retrying when the queue is full.
RETRY_AFTER = 1
#: Paths that need no API key.
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
#: Headers of a streamed response: no proxy or browser keeps or buffers it.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """How the server answers.

    Args:
        model_id: the name ``/v1/models`` gives the target and responses echo.
        model_aliases: other names a request's ``model`` may use (it is matched against
            these and otherwise ignored: never resolved as a file or alias).
        n_predict: tokens per response when a request sets no ``max_tokens`` (-1: until
            an end-of-generation token or a full context).
        sampler: sampling settings for requests that set none (``seed`` None: random).
        api_key: when set, every endpoint but ``/health`` needs
            ``Authorization: Bearer <api_key>``.
        max_queue: requests that may wait while one generates; more get 503.
        max_body_bytes: the largest request body (413 beyond).
        log_text: log each request's prompt and completion (DEBUG on ``specgguf.server``).
    """

    model_id: str
    model_aliases: tuple[str, ...] = ()
    n_predict: int = -1
    sampler: SamplerParams = dataclasses.field(default_factory=SamplerParams)
    api_key: str | None = None
    max_queue: int = 16
    max_body_bytes: int = 4 * 2**20
    log_text: bool = False


def timings(stats: GenerationStats) -> dict[str, Any]:
    """llama.cpp server's ``timings`` object for a generation (milliseconds, tokens/s):
    ``cache_n`` (prompt tokens reused from the cache), ``prompt_n`` (prompt tokens read),
    ``prompt_ms``, ``predicted_n``, ``predicted_ms``, their per-token and per-second rates,
    and ``draft_n``, ``draft_n_accepted`` (given always, 0 without drafts; llama.cpp's
    tools/server/server-common.cpp ``server_slot_stats::to_json``); under a grammar, always,
    also specgguf's ``draft_n_grammar`` (of ``draft_n``, the tokens the grammar forced) and
    ``draft_n_cut`` (drafters' tokens cut before verification)."""
    prompt_ms = stats.prompt_seconds * 1e3
    predicted_ms = stats.seconds * 1e3
    pn, gn = stats.prompt_read, stats.generated
    return {
        "cache_n": stats.prompt_cached,
        "prompt_n": pn,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / pn if pn else 0.0,
        "prompt_per_second": pn / stats.prompt_seconds if stats.prompt_seconds > 0 else 0.0,
        "predicted_n": gn,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / gn if gn else 0.0,
        "predicted_per_second": stats.tokens_per_s,
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
        **_grammar_counts(stats),
    }


def _grammar_counts(stats: GenerationStats) -> dict[str, int]:
    if not stats.constrained:
        return {}
    forced = stats.by_drafter.get("grammar")
    return {"draft_n_grammar": forced.drafted if forced else 0, "draft_n_cut": stats.grammar_cut}


def usage(stats: GenerationStats) -> dict[str, Any]:
    """OpenAI's ``usage``: prompt, completion and total tokens, and of the prompt's, those
    reused from the cache (``prompt_tokens_details.cached_tokens``)."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated,
        "total_tokens": stats.prompt_tokens + stats.generated,
        "prompt_tokens_details": {"cached_tokens": stats.prompt_cached},
    }


class _Service:
    """What the endpoints share: the engine, its scheduler, metrics and settings."""

    def __init__(self, engine: Engine, settings: ServerSettings, scheduler: Scheduler) -> None:
        self.engine = engine
        self.settings = settings
        self.scheduler = scheduler
        self.names = {settings.model_id, *settings.model_aliases}

    # -- request -> generation ------------------------------------------------------

    async def prompt_ids(
        self,
        prompt: Prompt,
        param: str,
        *,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool | None = None,
        tools: ToolSet | None = None,
    ) -> list[int]:
        """The prompt's token ids (a conversation with ``tools`` rendered by the chat
        template), checked against the vocabulary and the context.

        Raises:
            APIError: a chat template that fails (its message quoted) or does not render
                tools (``param`` "tools" or "messages"), a malformed conversation, token
                ids outside the vocabulary, a prompt that leaves no room to generate
                (``context_length_exceeded``).
        """
        engine = self.engine
        try:
            # Rendering and tokenizing read the model only: safe next to a generation.
            ids = await run_in_threadpool(
                functools.partial(
                    engine.prompt_ids,
                    prompt,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tools=tools.tools if tools else None,
                )
            )
        except ToolsTemplateError as e:
            where = "tools" if e.part == "tools" else param
            raise bad_request(str(e), param=where, code="chat_template_error") from None
        except (ChatTemplateError, ChatInputError) as e:
            raise bad_request(str(e), param=param, code="chat_template_error") from None
        except ContextOverflowError as e:  # found before tokenizing: a lower bound
            raise _too_long(e, param) from None
        except SpecggufError as e:
            raise bad_request(str(e), param=param) from None
        n_vocab = engine.target_model.n_vocab
        if not isinstance(prompt, str) and any(not 0 <= t < n_vocab for t in ids):
            raise bad_request(f"{param}: token ids must be in [0, {n_vocab})", param=param)
        if not ids:
            raise bad_request(f"{param}: the prompt is empty", param=param)
        if len(ids) >= engine.n_ctx:
            raise _too_long(ContextOverflowError(len(ids), engine.n_ctx), param)
        return ids

    def params(self, req: _Generation) -> GenerationParams:
        """The generation a request asks for: its settings, else the server's defaults;
        speculative settings within what was loaded.

        Raises:
            APIError: the model drafter without a draft model, the mtp drafter without MTP
                layers, a draft length above the
                loaded one, ``speculative.n_min`` above ``speculative.n_max``.
        """
        check_supported(req)
        if req.model is not None and req.model not in self.names:
            log.debug("request for model %r served by %s", req.model, self.settings.model_id)
        spec = self.engine.config.speculative
        if req.spec_drafter == "model" and self.engine.draft_model is None:
            raise bad_request(
                "speculative.drafter: the model drafter needs a draft model, and none "
                "was loaded", param="speculative.drafter",
            )  # fmt: skip
        if req.spec_drafter == "mtp" and self.engine.mtp_head is None:
            raise bad_request(
                "speculative.drafter: the mtp drafter needs the target's multi-token-"
                "prediction layers, and none were loaded", param="speculative.drafter",
            )  # fmt: skip
        n_max = req.spec_n_max
        if n_max is not None and n_max > spec.draft_max:
            raise bad_request(
                f"speculative.n_max: at most {spec.draft_max} (the largest draft length "
                "this server was started with)", param="speculative.n_max",
            )  # fmt: skip
        n_min = req.spec_n_min
        if n_min is not None and n_min > (spec.draft_max if n_max is None else n_max):
            raise bad_request(
                "speculative.n_min: the minimum draft length exceeds the maximum "
                "(speculative.n_max)", param="speculative.n_min",
            )  # fmt: skip
        if req.deterministic and not self.engine.deterministic_rows:
            raise bad_request(
                "deterministic: this server was not started in deterministic mode",
                param="deterministic",
            )  # fmt: skip
        d = self.settings.sampler
        seed = d.seed if req.seed is None else req.seed
        sampler = SamplerParams(
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_k=d.top_k if req.top_k is None else req.top_k,
            top_p=d.top_p if req.top_p is None else req.top_p,
            min_p=d.min_p if req.min_p is None else req.min_p,
            seed=None if seed is None or seed < 0 else seed,
        )
        n_predict = req.n_predict
        return GenerationParams(
            n_predict=self.settings.n_predict if n_predict is None else n_predict,
            sampler=sampler, stop=req.stops, ignore_eos=bool(req.ignore_eos),
            drafter=req.spec_drafter, draft_max=n_max, p_min=req.spec_p_min, draft_min=n_min,
            deterministic=req.deterministic, cache_prompt=req.cache_prompt is not False,
        )  # fmt: skip

    async def check_grammar(self, spec: GrammarSpec, param: str) -> None:
        """Compile a request's constraint for the target before it is queued (the engine
        keeps it for the generation).

        Raises:
            APIError: a schema, grammar or tool that cannot be used (``param`` names the
                request field; the message what is wrong).
        """
        try:
            await run_in_threadpool(self.engine.check_grammar, spec)
        except GrammarError as e:
            raise bad_request(f"{param}: {e}", param=param) from None
        except SpecggufError as e:
            raise bad_request(str(e), param=param) from None

    async def constrained(
        self, req: _Generation, params: GenerationParams, tools: ToolSet | None = None
    ) -> GenerationParams:
        """``params`` with the request's constraint on the output (and the stop strings
        its tools need), compiled.

        Raises:
            APIError: as :func:`~specgguf.server.schemas.constraint`,
                :func:`~specgguf.server.tools.output_constraint` and :meth:`check_grammar`;
                a tool whose parameters schema cannot be used (``param``
                ``tools.K.function.parameters``), whatever ``tool_choice`` says.
        """
        answer = constraint(req)
        found = output_constraint(answer, tools)
        stops = tools.stops() if tools else ()
        for k, tool in enumerate(tools.tools if tools else ()):
            # each tool's parameters, named, whether or not a call is forced
            schema = GrammarSpec("json_schema", json.dumps(parameters_schema(tool)))
            await self.check_grammar(schema, f"tools.{k}.function.parameters")
        if found is None:
            return dataclasses.replace(params, stop=params.stop + stops) if stops else params
        spec, param = found
        if answer is not None and answer[0] is not spec:  # its own faults named first
            await self.check_grammar(*answer)
        await self.check_grammar(spec, param)
        return dataclasses.replace(params, grammar=spec, stop=params.stop + stops)

    def submit(self, ids: list[int], params: GenerationParams, *, stream: bool) -> Job:
        """Queue a generation; its text pieces are passed on only for a ``stream``.

        Raises:
            APIError: 503 with ``Retry-After`` when the queue is full or the server stops.
        """
        job = Job(ids, params, pieces=stream)
        try:
            self.scheduler.submit(job)
        except QueueFull:
            raise APIError(
                503, f"the server is busy: {_waiting(self.scheduler.max_queue)}; retry "
                "later", type="server_error", code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER)},
            ) from None  # fmt: skip
        except ShuttingDown:
            raise _shutting_down() from None
        return job

    # -- generation -> response -----------------------------------------------------

    async def result(self, job: Job, request: Request, label: str) -> GenerationResult | None:
        """Wait for a job's result; None when the client went away first (the job is
        cancelled then, and logged under ``label``).

        Raises:
            APIError: the generation failed, or the server is stopping.
        """

        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        async def finished() -> GenerationResult:
            async for ev in job.events():
                if ev.kind == "error":
                    raise _job_error(ev.error)
                if ev.kind == "done":
                    return _finished(ev.result)
            raise AssertionError("a job's events end with done or error")

        waiter = asyncio.ensure_future(finished())
        watcher = asyncio.ensure_future(gone())
        try:
            await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if waiter.done():
                return waiter.result()
            _log_cancelled(label)
            return None
        finally:
            job.delivered.set()
            job.cancel()  # no-op once finished
            for task in (waiter, watcher):
                task.cancel()
            with contextlib.suppress(BaseException):
                await watcher

    async def stream(
        self,
        job: Job,
        head: Sequence[dict[str, Any]],
        piece: Callable[[str], list[dict[str, Any]]],
        tail: Callable[[GenerationResult], list[dict[str, Any]]],
        label: str,
    ) -> AsyncIterator[bytes]:
        """Server-sent events: ``head`` chunks, the chunks of each text piece (none while
        it is held back), the ``tail`` chunks of the result, then ``data: [DONE]``; an
        error mid-stream is one event with OpenAI's error object. A client that
        disconnects cancels this iterator, and so the job (logged under ``label``)."""
        ended = False
        try:
            for chunk in head:
                yield _sse(chunk)
            async for ev in job.events():
                if ev.kind == "piece":
                    for chunk in piece(ev.text):
                        yield _sse(chunk)
                    continue
                try:
                    if ev.kind == "error":
                        raise _job_error(ev.error)
                    result = _finished(ev.result)
                except APIError as e:
                    ended = True
                    log.info("%s: %d %s", label, e.status, e.message)
                    yield _sse(e.body())
                    return
                for chunk in tail(result):
                    yield _sse(chunk)
                ended = True
                yield format_sse_event(data_str="[DONE]")
                self.log_result(label, result)
                return
        finally:
            if not ended:
                _log_cancelled(label)
            job.delivered.set()
            job.cancel()

    def log_result(self, label: str, result: GenerationResult, prompt: Any = None) -> None:
        s = result.stats
        acc = (
            f", acceptance {s.acceptance_rate:.0%} ({s.accepted}/{s.drafted})" if s.drafted else ""
        )
        log.info(
            "%s: %d prompt tokens, %d tokens in %.2f s, %.2f tokens/s%s; finish: %s",
            label, s.prompt_tokens, s.generated, s.seconds, s.tokens_per_s, acc,
            result.finish_reason,
        )  # fmt: skip
        if self.settings.log_text:
            log.debug("%s: completion: %r", label, result.text)


async def parse(request: Request, model: type[R], limit: int) -> R:
    """The request body as ``model``: JSON whatever the Content-Type says (as llama.cpp's
    server reads it; ``curl -d`` sends a form type), validated strictly.

    Raises:
        APIError: a body over ``limit`` bytes (413; refused by its Content-Length before
            it is read, or as soon as it grows past the limit); malformed JSON, or the
            first problem pydantic finds (400).
    """
    too_large = APIError(
        413, f"the request body is larger than {limit} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    body = b"".join(chunks)
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def _finished(result: GenerationResult | None) -> GenerationResult:
    """A result to answer with; a cancelled generation is the server stopping (a client
    that went away is not listening any more)."""
    if result is None or result.finish_reason == "interrupted":
        raise _shutting_down()
    return result


def _log_cancelled(label: str) -> None:
    log.info("%s: the client went away; its generation was cancelled", label)


def _waiting(max_queue: int) -> str:
    if max_queue == 0:
        return "a request is generating and none may wait (--max-queue 0)"
    return f"{max_queue} request{'s are' if max_queue > 1 else ' is'} waiting already"


def _too_long(err: ContextOverflowError, param: str) -> APIError:
    """OpenAI's ``context_length_exceeded``, with the numbers (``n_prompt_tokens`` a lower
    bound when the prompt was refused before it was tokenized)."""
    return APIError(
        400, str(err), param=param, code="context_length_exceeded",
        n_prompt_tokens=err.n_prompt, n_ctx=err.n_ctx,
    )  # fmt: skip


def _shutting_down() -> APIError:
    return APIError(
        503, "the server is shutting down", type="server_error", code="server_shutting_down"
    )


def _job_error(err: BaseException | None) -> APIError:
    if isinstance(err, APIError):
        return err
    if isinstance(err, ShuttingDown):
        return _shutting_down()
    if isinstance(err, BackendError):
        log.error("llama.cpp failed: %s", err)
        return APIError(500, f"llama.cpp failed: {err}", type="server_error")
    if isinstance(err, SpecggufError):
        return bad_request(str(err))
    log.error("generation failed: %s: %s", type(err).__name__, err, exc_info=err)
    return APIError(500, "internal server error", type="server_error")


def _call_deltas(parsed: ParsedMessage) -> list[dict[str, Any]]:
    """The streamed ``delta.tool_calls`` items of an answer's calls, as OpenAI sends them:
    per call, its index, id, type and name with empty arguments, then its arguments."""
    out: list[dict[str, Any]] = []
    for i, call in enumerate(parsed.calls):
        out.append({"index": i, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}})  # fmt: skip
        out.append({"index": i, "function": {"arguments": call.arguments}})
    return out


def _sse(obj: dict[str, Any]) -> bytes:
    return format_sse_event(data_str=json.dumps(obj, ensure_ascii=False))


# -- middleware -----------------------------------------------------------------------


class _RequireKey:
    """Every path but :data:`PUBLIC_PATHS` needs ``Authorization: Bearer KEY``, compared
    in constant time (:func:`secrets.compare_digest`); otherwise 401. Runs before the
    body is read."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                err = APIError(
                    401, "invalid or missing API key (send Authorization: Bearer KEY)",
                    type="authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )  # fmt: skip
                await refused(scope["method"], scope["path"], err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _CountRequests:
    """Counts every answered request by endpoint and HTTP status."""

    def __init__(self, app: ASGIApp, metrics: Metrics, paths: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            # the route's path (/v1/models/{model:path}), never a client's: a label each
            # (a request refused before routing, 401: its path, when it is a route's)
            route = getattr(scope.get("route"), "path", scope["path"])
            path = route if route in self.paths else "other"
            self.metrics.requests.labels(path, str(status)).inc()


# -- the application ------------------------------------------------------------------


def create_app(
    engine: Engine, settings: ServerSettings, *, executor: ThreadPoolExecutor | None = None
) -> FastAPI:
    """The ASGI application over a loaded ``engine``. Its scheduler
    (``app.state.scheduler``, with ``settings.max_queue``) starts its worker now, on
    ``executor``'s thread when given (the thread that loaded the engine: see
    :func:`specgguf.server.scheduler.engine_thread`), and is closed when the application
    shuts down; join it before closing the engine.
    """
    sched: Scheduler
    metrics = Metrics(lambda: sched.waiting, lambda: sched.running, engine.prompt_cache)
    sched = Scheduler(engine, settings.max_queue, on_result=metrics.observe, executor=executor)
    svc = _Service(engine, settings, sched)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        sched.close()

    app = FastAPI(
        title="specgguf", version=__version__, docs_url=None, redoc_url=None,
        openapi_url=None, lifespan=lifespan,
    )  # fmt: skip
    app.state.service = svc
    app.state.scheduler = sched
    app.state.metrics = metrics
    install_handlers(app)

    def envelope(kind: str, prefix: str) -> dict[str, Any]:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": settings.model_id, "system_fingerprint": f"specgguf-{__version__}",
        }  # fmt: skip

    @app.post("/v1/chat/completions", response_model=None)
    @app.post("/chat/completions", response_model=None, include_in_schema=False)
    async def chat_completions(request: Request) -> Response:
        req = await parse(request, ChatCompletionRequest, settings.max_body_bytes)
        params = svc.params(req)
        tools = req.tool_set()
        conversation = req.conversation()
        params = await svc.constrained(req, params, tools)
        ids = await svc.prompt_ids(
            conversation, "messages",
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, tools=tools,
        )  # fmt: skip
        if settings.log_text:
            log.debug("chat: messages: %r", conversation)
        job = svc.submit(ids, params, stream=bool(req.stream))
        base = envelope("chat.completion.chunk" if req.stream else "chat.completion", "chatcmpl")
        label = "POST /v1/chat/completions"
        call_names = tools.callable if tools and tools.parses else None
        if req.stream:
            splitter = ToolCallStream(call_names) if call_names is not None else None

            def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                return {**base, "choices": [c]}

            def piece(text: str) -> list[dict[str, Any]]:
                if splitter is None:
                    return [choice({"content": text})]
                text = splitter.feed(text)  # nothing of what may be a tool call
                return [choice({"content": text})] if text else []

            def tail(result: GenerationResult) -> list[dict[str, Any]]:
                chunks, finish = [], str(result.finish_reason)
                if splitter is not None:
                    rest, parsed = splitter.finish(result.text)
                    if rest:
                        chunks.append(choice({"content": rest}))
                    chunks += [choice({"tool_calls": [d]}) for d in _call_deltas(parsed)]
                    finish = "tool_calls" if parsed.calls else finish
                chunks.append(choice({}, finish))
                if req.include_usage:
                    chunks.append({**base, "choices": [], "usage": usage(result.stats)})
                chunks[-1]["timings"] = timings(result.stats)  # llama.cpp: on the last chunk
                return chunks

            head = [choice({"role": "assistant", "content": ""})]
            return EventSourceResponse(
                svc.stream(job, head, piece, tail, label), headers=SSE_HEADERS
            )
        result = await svc.result(job, request, label)
        if result is None:
            return Response(status_code=499)  # nobody is listening
        svc.log_result(label, result)
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        finish = str(result.finish_reason)
        if call_names is not None:
            parsed = parse_tool_calls(result.text, call_names)
            if parsed.calls:
                message = {"role": "assistant", "content": parsed.content,
                           "tool_calls": [c.openai() for c in parsed.calls]}  # fmt: skip
                finish = "tool_calls"
        body = {
            **base,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish}],
            "usage": usage(result.stats), "timings": timings(result.stats),
        }  # fmt: skip
        return JSONResponse(body)

    @app.post("/v1/completions", response_model=None)
    @app.post("/completions", response_model=None, include_in_schema=False)
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest, settings.max_body_bytes)
        params = await svc.constrained(req, svc.params(req))
        prompt = req.prompt_input()
        ids = await svc.prompt_ids(prompt, "prompt")
        if settings.log_text:
            log.debug("completion: prompt: %r", prompt)
        job = svc.submit(ids, params, stream=bool(req.stream))
        base = envelope("text_completion", "cmpl")
        label = "POST /v1/completions"

        def choice(text: str, finish: str | None = None) -> dict[str, Any]:
            return {**base, "choices": [{"index": 0, "text": text, "logprobs": None,
                                         "finish_reason": finish}]}  # fmt: skip

        def piece(text: str) -> list[dict[str, Any]]:
            return [choice(text)]

        if req.stream:

            def tail(result: GenerationResult) -> list[dict[str, Any]]:
                chunks = [choice("", result.finish_reason)]
                if req.include_usage:
                    chunks.append({**base, "choices": [], "usage": usage(result.stats)})
                chunks[-1]["timings"] = timings(result.stats)
                return chunks

            return EventSourceResponse(svc.stream(job, [], piece, tail, label), headers=SSE_HEADERS)
        result = await svc.result(job, request, label)
        if result is None:
            return Response(status_code=499)
        svc.log_result(label, result)
        body = choice(result.text, result.finish_reason)
        body.update(usage=usage(result.stats), timings=timings(result.stats))
        return JSONResponse(body)

    def model_card() -> dict[str, Any]:
        d = engine.describe()
        meta = {
            "target": engine.target_model.path.name,
            "draft": engine.draft_model.path.name if engine.draft_model else None,
            "drafter": d["drafter"], "draft_max": d["draft_max"], "n_ctx": d["n_ctx"],
            "n_ctx_draft": d["n_ctx_draft"], "n_vocab": engine.target_model.n_vocab,
        }  # fmt: skip
        model = {
            "id": settings.model_id, "object": "model", "created": int(time.time()),
            "owned_by": "specgguf", "aliases": list(settings.model_aliases), "meta": meta,
        }  # fmt: skip
        return model

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    @app.api_route("/models", methods=["GET", "HEAD"], include_in_schema=False)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    @app.api_route("/models/{model:path}", methods=["GET", "HEAD"], include_in_schema=False)
    async def one_model(model: str) -> dict[str, Any]:
        """OpenAI's "retrieve model": the target under any of its names; 404 otherwise
        (``/v1/models/``: the list)."""
        if not model:
            return await models()
        if model not in svc.names:
            raise APIError(
                404, f"no model {model!r} here: this server serves {settings.model_id!r}",
                type="not_found_error", param="model", code="model_not_found",
            )  # fmt: skip
        return model_card()

    @app.api_route("/health", methods=["GET", "HEAD"])
    @app.api_route("/v1/health", methods=["GET", "HEAD"], include_in_schema=False)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    if settings.api_key:
        app.add_middleware(_RequireKey, key=settings.api_key)
    paths = frozenset(r.path for r in app.routes if hasattr(r, "path"))
    app.add_middleware(_CountRequests, metrics=metrics, paths=paths)
    return app
