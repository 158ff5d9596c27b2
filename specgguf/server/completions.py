"""OpenAI's chat and text completion endpoints, as llama.cpp's server gives them (with its
``timings``): ``POST /v1/chat/completions`` and ``POST /v1/completions`` (and both
without ``/v1``). A chat answer with tool calls (:mod:`specgguf.server.tools`) comes back
as ``message.tool_calls`` or, streamed, as ``delta.tool_calls`` chunks at the end, with
``finish_reason`` ``"tool_calls"``. A response streams as server-sent events
(``fastapi.sse``'s framing) or comes whole; either way, a client that goes away cancels
its generation (:meth:`~specgguf.server.scheduler.Job.cancel`).
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse

from specgguf.server.scheduler import Job
from specgguf.server.schemas import ChatCompletionRequest, CompletionRequest
from specgguf.server.service import SSE_HEADERS, Service, log, parse, timings, usage
from specgguf.server.tools import ParsedMessage, ToolCallStream, parse_tool_calls
from specgguf.speculative.loop import GenerationResult

router = APIRouter()
CHAT = "POST /v1/chat/completions"
TEXT = "POST /v1/completions"


def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


@router.post("/v1/chat/completions", response_model=None)
@router.post("/chat/completions", response_model=None, include_in_schema=False)
async def chat_completions(request: Request) -> Response:
    svc = _service(request)
    req = await parse(request, ChatCompletionRequest, svc.settings.max_body_bytes)
    tools = req.tool_set()
    # A marker of this request's own where its images go: a conversation may hold any
    # text, llama.cpp's default marker included (llama.cpp #21955).
    marker = f"<__media_{secrets.token_hex(8)}__>"
    conversation, media = req.conversation(marker), req.media(svc.settings.remote_media)
    params = await svc.constrained(req, svc.params(req), tools)
    ids, spans = await svc.prompt_ids(
        conversation, "messages",
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, tools=tools, media=media,
        marker=marker,
    )  # fmt: skip
    if svc.settings.log_text:
        log.debug("chat: messages: %r", conversation)
    job = svc.submit(ids, params, stream=bool(req.stream), media=spans)
    call_names = tools.callable if tools and tools.parses else None
    if req.stream:
        return _chat_stream(svc, job, call_names, include_usage=req.include_usage)
    return await _chat_whole(svc, job, request, call_names)


def _chat_stream(
    svc: Service, job: Job, call_names: Any, *, include_usage: bool
) -> EventSourceResponse:
    """The chat answer as server-sent events: the role, the text (none of what may be a
    tool call), then the tool calls, the finish reason, the usage and the timings."""
    base = svc.envelope("chat.completion.chunk", "chatcmpl")
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
        if include_usage:
            chunks.append({**base, "choices": [], "usage": usage(result.stats)})
        chunks[-1]["timings"] = timings(result.stats)  # llama.cpp: on the last chunk
        return chunks

    head = [choice({"role": "assistant", "content": ""})]
    return EventSourceResponse(svc.stream(job, head, piece, tail, CHAT), headers=SSE_HEADERS)


async def _chat_whole(svc: Service, job: Job, request: Request, call_names: Any) -> Response:
    """The chat answer whole: its message (with its tool calls, parsed), usage, timings."""
    result = await svc.result(job, request, CHAT)
    if result is None:
        return Response(status_code=499)  # nobody is listening
    svc.log_result(CHAT, result)
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    finish = str(result.finish_reason)
    if call_names is not None:
        parsed = parse_tool_calls(result.text, call_names)
        if parsed.calls:
            message = {"role": "assistant", "content": parsed.content,
                       "tool_calls": [c.openai() for c in parsed.calls]}  # fmt: skip
            finish = "tool_calls"
    body = {
        **svc.envelope("chat.completion", "chatcmpl"),
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": finish}],
        "usage": usage(result.stats), "timings": timings(result.stats),
    }  # fmt: skip
    return JSONResponse(body)


def _call_deltas(parsed: ParsedMessage) -> list[dict[str, Any]]:
    """The streamed ``delta.tool_calls`` items of an answer's calls, as OpenAI sends them:
    per call, its index, id, type and name with empty arguments, then its arguments."""
    out: list[dict[str, Any]] = []
    for i, call in enumerate(parsed.calls):
        out.append({"index": i, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}})  # fmt: skip
        out.append({"index": i, "function": {"arguments": call.arguments}})
    return out


@router.post("/v1/completions", response_model=None)
@router.post("/completions", response_model=None, include_in_schema=False)
async def completions(request: Request) -> Response:
    svc = _service(request)
    req = await parse(request, CompletionRequest, svc.settings.max_body_bytes)
    params = await svc.constrained(req, svc.params(req))
    prompt = req.prompt_input()
    ids, _ = await svc.prompt_ids(prompt, "prompt")
    if svc.settings.log_text:
        log.debug("completion: prompt: %r", prompt)
    job = svc.submit(ids, params, stream=bool(req.stream))
    base = svc.envelope("text_completion", "cmpl")

    def choice(text: str, finish: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "text": text, "logprobs": None,
                                     "finish_reason": finish}]}  # fmt: skip

    if req.stream:

        def tail(result: GenerationResult) -> list[dict[str, Any]]:
            chunks = [choice("", result.finish_reason)]
            if req.include_usage:
                chunks.append({**base, "choices": [], "usage": usage(result.stats)})
            chunks[-1]["timings"] = timings(result.stats)
            return chunks

        stream = svc.stream(job, [], lambda text: [choice(text)], tail, TEXT)
        return EventSourceResponse(stream, headers=SSE_HEADERS)
    result = await svc.result(job, request, TEXT)
    if result is None:
        return Response(status_code=499)
    svc.log_result(TEXT, result)
    body = choice(result.text, result.finish_reason)
    body.update(usage=usage(result.stats), timings=timings(result.stats))
    return JSONResponse(body)
