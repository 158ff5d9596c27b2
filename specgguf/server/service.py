"""What the server's endpoints share (:class:`Service`): a request's settings, prompt and
constraint checked and turned into a queued job; its result or its stream turned into a
response; llama.cpp server's ``timings`` and OpenAI's ``usage`` of a generation.

A request is checked (types and ranges by pydantic, unsupported features by name), its
prompt rendered and tokenized and checked against the context, its constraint on the output
(a JSON Schema, a grammar, forced tool calls) compiled, before it is queued; so every bad
request is a 4xx with OpenAI's error shape before any generation starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from fastapi import Request
from fastapi.sse import format_sse_event
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from specgguf.errors import (
    BackendError,
    ChatInputError,
    ChatTemplateError,
    ContextOverflowError,
    GrammarError,
    MediaError,
    SpecggufError,
    ToolsTemplateError,
)
from specgguf.server.errors import APIError, bad_request, validation_error
from specgguf.server.scheduler import Job, QueueFull, Scheduler, ShuttingDown
from specgguf.server.schemas import _Generation, check_supported, constraint
from specgguf.server.tools import ToolSet, output_constraint, parameters_schema
from specgguf.speculative.grammar import GrammarSpec
from specgguf.speculative.loop import GenerationParams, GenerationResult, GenerationStats
from specgguf.speculative.sampling import SamplerParams
from specgguf.version import __version__

if TYPE_CHECKING:
    from specgguf.engine import Engine, Prompt
    from specgguf.llama.backend import MediaSpan

log = logging.getLogger("specgguf.server")
R = TypeVar("R", bound=BaseModel)

#: Seconds a client is told to wait before retrying when the queue is full.
RETRY_AFTER = 1
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
        allowed_hosts: names the ``Host`` header may give besides IP addresses,
            ``localhost`` and this machine's name (``.name``: every name under it).
        cors_origins: origins of web pages that may use the server (CORS; ``*``: any;
            ``localhost``: any page on this machine); empty: none but its own.
        remote_media: hosts (``host`` or ``host:port``) whose http(s) image addresses
            the server fetches (``--allow-remote-media``); empty: none, only ``data:``
            URIs.
    """

    model_id: str
    model_aliases: tuple[str, ...] = ()
    n_predict: int = -1
    sampler: SamplerParams = dataclasses.field(default_factory=SamplerParams)
    api_key: str | None = None
    max_queue: int = 16
    max_body_bytes: int = 4 * 2**20
    log_text: bool = False
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    remote_media: tuple[str, ...] = ()


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


class Service:
    """What the endpoints share: the engine, its scheduler, metrics and settings."""

    def __init__(self, engine: Engine, settings: ServerSettings, scheduler: Scheduler) -> None:
        self.engine = engine
        self.settings = settings
        self.scheduler = scheduler
        self.names = {settings.model_id, *settings.model_aliases}
        self._media_lock = asyncio.Lock()

    def envelope(self, kind: str, prefix: str) -> dict[str, Any]:
        """A response's common fields: a new id, its object ``kind``, the time, the model."""
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": self.settings.model_id, "system_fingerprint": f"specgguf-{__version__}",
        }  # fmt: skip

    # -- request -> generation ------------------------------------------------------

    async def prompt_ids(
        self,
        prompt: Prompt,
        param: str,
        *,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool | None = None,
        tools: ToolSet | None = None,
        media: Sequence[tuple[str, bytes | str]] = (),
        marker: str | None = None,
    ) -> tuple[list[int], list[MediaSpan]]:
        """The prompt's token ids (a conversation with ``tools`` rendered by the chat
        template), checked against the vocabulary and the context, and where the
        conversation's text holds ``marker`` for each of ``media`` (``(part name,
        bytes)``, or an address to fetch first on a host ``--allow-remote-media`` names),
        their embeddings at their positions (:meth:`Engine.media_prompt`), encoded
        between two generations, or each chunk (an image, 30 s of a clip) between two
        steps of parallel sequences (``Scheduler.turn``), and only when the queue has
        room.

        Raises:
            APIError: a chat template that fails (its message quoted) or does not render
                tools (``param`` "tools" or "messages"), a malformed conversation, token
                ids outside the vocabulary, a prompt that leaves no room to generate
                (``context_length_exceeded``), an image that cannot be read or no
                projector loaded (its part named).
        """
        engine = self.engine
        spans: list[MediaSpan] = []
        try:
            if media:

                def fetch() -> list[tuple[str, bytes]]:
                    """The images (those at addresses fetched), checked: what can be
                    refused is, before a generation is waited for."""
                    from specgguf.llama.media import MAX_BYTES
                    from specgguf.server.remote import fetch_image

                    images = [(name, data if isinstance(data, bytes) else
                               fetch_image(data, name, self.settings.remote_media, MAX_BYTES))
                              for name, data in media]  # fmt: skip
                    engine.check_media(images)
                    return images

                def encode(images: list[tuple[str, bytes]]) -> tuple[list[int], list[MediaSpan]]:
                    prepared = engine.render(
                        cast("Sequence[Mapping[str, Any]]", prompt),  # (chat: media's only)
                        add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message,
                        tools=tools.tools if tools else None,
                    )
                    # With parallel sequences, each chunk (an image, 30 s of a clip) is
                    # encoded between two steps, in a turn of its own: the sequences that
                    # generate go on between them. One sequence at a time: the request's
                    # media in one turn between two generations (a turn for each would let
                    # a queued generation run whole between them). A server that stops
                    # ends the encoding at its next chunk.
                    each = self.scheduler.turn if self.scheduler.parallel > 1 else None
                    with contextlib.nullcontext() if each else self.scheduler.turn():
                        return engine.media_prompt(prepared, images, marker=marker,
                                                   stop=lambda: self.scheduler.closed,
                                                   turn=each)  # fmt: skip

                # A place in the queue first (before the images' arithmetic is spent, and
                # so that requests waiting for their turn to encode count as waiting).
                with self.scheduler.reserve():
                    images = await run_in_threadpool(fetch)
                    async with self._media_lock:  # (one request's images at a time)
                        ids, spans = await run_in_threadpool(encode, images)
            else:
                # Rendering and tokenizing read the model only: safe next to a generation.
                ids = await run_in_threadpool(
                    functools.partial(
                        engine.prompt_ids, prompt, add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message,
                        tools=tools.tools if tools else None,
                    )
                )  # fmt: skip
        except ToolsTemplateError as e:
            where = "tools" if e.part == "tools" else param
            raise bad_request(str(e), param=where, code="chat_template_error") from None
        except QueueFull:
            raise _queue_full(self.scheduler.max_queue) from None
        except ShuttingDown:
            raise _shutting_down() from None
        except (ChatTemplateError, ChatInputError) as e:
            if self.scheduler.closed:  # (the template's worker stopped with the server)
                raise _shutting_down() from None
            raise bad_request(str(e), param=param, code="chat_template_error") from None
        except ContextOverflowError as e:  # found before tokenizing: a lower bound
            raise _too_long(e, param) from None
        except MediaError as e:
            raise bad_request(str(e), param=e.part) from None
        except BackendError as e:  # (the projector's arithmetic failed: not the request's)
            if self.scheduler.closed:  # (or was stopped with the server)
                raise _shutting_down() from None
            raise _job_error(e) from None
        except SpecggufError as e:
            if self.scheduler.closed:  # (the template's worker stopped with the server)
                raise _shutting_down() from None
            raise bad_request(str(e), param=param) from None
        n_vocab = engine.target_model.n_vocab
        if not isinstance(prompt, str) and not media and any(not 0 <= t < n_vocab for t in ids):
            raise bad_request(f"{param}: token ids must be in [0, {n_vocab})", param=param)
        if not ids:
            raise bad_request(f"{param}: the prompt is empty", param=param)
        if len(ids) >= engine.n_ctx:
            raise _too_long(ContextOverflowError(len(ids), engine.n_ctx), param)
        return ids, spans

    def params(self, req: _Generation) -> GenerationParams:
        """The generation a request asks for: its settings, else the server's defaults;
        speculative settings within what was loaded.

        Raises:
            APIError: a drafter whose needs were not loaded (a draft model, MTP layers),
                a draft length above the
                loaded one, ``speculative.n_min`` above ``speculative.n_max``.
        """
        check_supported(req)
        if req.model is not None and req.model not in self.names:
            log.debug("request for model %r served by %s", req.model, self.settings.model_id)
        spec = self.engine.config.speculative
        if req.spec_drafter and (why := self.engine.missing(req.spec_drafter)) is not None:
            raise bad_request(f"speculative.drafter: {why}", param="speculative.drafter")
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

    def submit(
        self,
        ids: list[int],
        params: GenerationParams,
        *,
        stream: bool,
        media: Sequence[MediaSpan] = (),
    ) -> Job:
        """Queue a generation (``media``: what the target reads at some of the prompt's
        positions, from :meth:`prompt_ids`); its text pieces are passed on only for a
        ``stream``.

        Raises:
            APIError: 503 with ``Retry-After`` when the queue is full or the server stops.
        """
        job = Job(ids, params, pieces=stream, media=media)
        try:
            self.scheduler.submit(job)
        except QueueFull:
            raise _queue_full(self.scheduler.max_queue) from None
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
        pieces = 0
        try:
            for chunk in head:
                yield _sse(chunk)
            async for ev in job.events():
                if ev.kind == "piece":
                    pieces += 1
                    for chunk in piece(ev.text):
                        yield _sse(chunk)
                    continue
                try:
                    if ev.kind == "error":
                        raise _job_error(ev.error)
                    result = _finished(ev.result)
                except APIError as e:
                    ended = True
                    if e.code == "server_shutting_down":  # after the 200 that started it
                        done = (f"{ev.result.stats.generated} tokens" if ev.result is not None
                                else f"{pieces} text pieces")  # fmt: skip
                        log.info("%s: stream ended by shutdown after %s", label, done)
                    else:
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
    """The request body as ``model``, validated strictly (its Content-Type was checked to be
    JSON before: :class:`specgguf.server.guard.Guard`).

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


def _queue_full(max_queue: int) -> APIError:
    return APIError(
        503, f"the server is busy: {_waiting(max_queue)}; retry later", type="server_error",
        code="queue_full", headers={"Retry-After": str(RETRY_AFTER)},
    )  # fmt: skip


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


def _sse(obj: dict[str, Any]) -> bytes:
    return format_sse_event(data_str=json.dumps(obj, ensure_ascii=False))
