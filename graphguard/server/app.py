"""The FastAPI app: routes, lifespan (engine start/stop), request metrics, and the
middleware that checks the Host header, the API key and the body size before any route."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from graphguard.engine.engine import LLMEngine
from graphguard.engine.generation_config import generation_defaults
from graphguard.engine.tokens.tokenizer import read_template
from graphguard.server import protocol as p
from graphguard.server import responses as r
from graphguard.server import tokenization as tok
from graphguard.server.async_engine import AsyncEngine
from graphguard.server.body_limit import BodyLimitMiddleware
from graphguard.server.config import ServerConfig
from graphguard.server.context import ServingContext
from graphguard.server.errors import install_error_handlers
from graphguard.server.handlers import create_chat_completion, create_completion
from graphguard.server.metrics import ServerMetrics
from graphguard.server.openapi import ServerAPI, error_responses, streamed
from graphguard.server.security import APIKeyMiddleware, HostCheckMiddleware
from graphguard.server.served import ServedEngine
from graphguard.server.tool_parsers import tool_call_format

ENDPOINTS = frozenset(
    {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/graphs"}
    | {"/tokenize", "/detokenize", "/tokenizer_info"}
)
MODEL_PATH_PREFIX = "/v1/models/"  # GET /v1/models/{model_id}, one metrics label for all ids
GENERATION_ERRORS = error_responses(400, 404, 503)  # what the generation routes may answer

router = APIRouter()


def build_app(engine: LLMEngine | ServedEngine, config: ServerConfig) -> FastAPI:
    """An app serving `engine`: an engine process already launched (EngineProcessClient), or
    an LLMEngine stepped on a thread of this process. Its lifespan starts serving and, on
    exit, aborts in-flight requests and shuts the engine down."""
    served = AsyncEngine(engine) if isinstance(engine, LLMEngine) else engine
    info, metrics = served.info, ServerMetrics()
    template, tokenizer = read_template(config.chat_template), info.tokenizer
    serving = ServingContext(
        engine=served,
        metrics=metrics,
        tokenizer=tokenizer,
        model_name=config.model_name,
        max_model_len=info.max_model_len,
        vocab_size=info.model_config.vocab_size,
        max_pool_tokens=info.stats["kv_blocks_total"] * info.block_size,
        max_token_chars=info.tokenizer.max_token_chars,
        permissive=config.permissive,
        defaults=generation_defaults(config.generation_config, info.model_folder),
        chat_template=template,
        isolate_prefixes=config.prefix_cache_isolation == "key",
        tool_format=tool_call_format(config.tool_call_parser, template or tokenizer.chat_template),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        served.start()
        yield
        await asyncio.to_thread(served.shutdown)

    app = ServerAPI(
        config,
        chunks=(r.ChatCompletionChunk,),  # a completions chunk is a CompletionResponse
        title="graphguard",
        summary="OpenAI-compatible server",
        lifespan=lifespan,
    )
    app.state.serving = serving
    install_error_handlers(app)
    _add_middleware(app, config, metrics)
    app.include_router(router)
    return app


def _add_middleware(app: FastAPI, config: ServerConfig, metrics: ServerMetrics) -> None:
    """Outermost first when a request arrives: metrics (which count every refusal), the Host
    check, the API key, then the body limit, so no body is read for a refused caller."""
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=config.max_request_bytes, timeout_s=config.body_timeout_s
    )
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys)
    if config.allowed_host_names is not None:
        app.add_middleware(HostCheckMiddleware, allowed=config.allowed_host_names)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)  # added last: outermost


async def _serving(request: Request) -> ServingContext:
    # NOTE: async: FastAPI runs a plain function dependency on a worker thread, a hop there
    # and back on every request for an attribute read
    serving: ServingContext = request.app.state.serving
    return serving


Serving = Annotated[ServingContext, Depends(_serving)]


@router.get(
    "/health",
    response_model=r.Health,
    responses={503: {"model": r.Health, "description": "Shutting down"}},
)
async def health(ctx: Serving) -> JSONResponse:
    if not ctx.engine.is_running:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/v1/models")
async def list_models(ctx: Serving) -> r.ModelList:
    return r.ModelList(data=[_model_card(ctx)])


@router.get(MODEL_PATH_PREFIX + "{model_id:path}", responses=error_responses(404))
async def retrieve_model(model_id: str, ctx: Serving) -> r.ModelCard:
    ctx.check_model(model_id)  # a 404 (model_not_found) for any other id
    return _model_card(ctx)


def _model_card(ctx: ServingContext) -> r.ModelCard:
    return r.ModelCard(id=ctx.model_name, max_model_len=ctx.max_model_len)


@router.post(
    "/v1/completions",
    response_model=r.CompletionResponse,
    responses={**streamed(r.CompletionResponse), **GENERATION_ERRORS},
)
async def completions(body: p.CompletionRequest, request: Request, ctx: Serving) -> Response:
    return await create_completion(ctx, request, body)


@router.post(
    "/v1/chat/completions",
    response_model=r.ChatCompletionResponse,
    responses={**streamed(r.ChatCompletionChunk), **GENERATION_ERRORS},
)
async def chat_completions(
    body: p.ChatCompletionRequest, request: Request, ctx: Serving
) -> Response:
    return await create_chat_completion(ctx, request, body)


@router.post("/tokenize", responses=error_responses(400, 404))
async def tokenize(body: tok.TokenizeRequest, ctx: Serving) -> r.TokenizeResponse:
    return await tok.tokenize(ctx, body)


@router.post("/detokenize", responses=error_responses(400, 404))
async def detokenize(body: tok.DetokenizeRequest, ctx: Serving) -> r.DetokenizeResponse:
    return await tok.detokenize(ctx, body)


@router.get("/tokenizer_info")
async def get_tokenizer_info(ctx: Serving) -> r.TokenizerInfo:
    return tok.tokenizer_info(ctx)


@router.get("/metrics", response_class=PlainTextResponse)  # the Prometheus text format
async def get_metrics(ctx: Serving) -> Response:
    ctx.metrics.observe_engine(ctx.engine.stats())
    # The graph registry's collectors take the graph cache's lock: keep that off the loop.
    body = await asyncio.to_thread(ctx.metrics.render, ctx.engine.graph_registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/graphs", response_model=r.GraphsReport)
async def get_graphs(ctx: Serving) -> JSONResponse:
    # The decode graphs' stats with the prefill graphs' under "prefill", or why graphs are off.
    return JSONResponse(_jsonable(await ctx.engine.graphs_report()))


def _jsonable(value: Any) -> Any:
    """`value` with dict keys as strings and unknown objects as their str(), for JSON."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class RequestMetricsMiddleware:
    """Counts every HTTP response by endpoint and status, including unhandled errors."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = _endpoint_label(scope.get("path", ""))
        is_started = False

        async def counting_send(message: Message) -> None:
            nonlocal is_started
            if message["type"] == "http.response.start":
                is_started = True
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not is_started:  # the outer error middleware will answer 500
                self.metrics.requests.labels(endpoint, "500").inc()
            raise


def _endpoint_label(path: str) -> str:
    """The `endpoint` label of a request: its route, never a client-chosen string."""
    if path in ENDPOINTS:
        return path
    return MODEL_PATH_PREFIX + "{model_id}" if path.startswith(MODEL_PATH_PREFIX) else "other"
