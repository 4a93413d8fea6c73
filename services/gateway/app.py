"""The FastAPI application: routes, error mapping, body limit, health."""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.body_limit import BodyLimit
from services.gateway.completions import router as completions_router
from services.gateway.context import GatewayContext
from services.gateway.errors_http import on_http_error, on_lorafleet_error, on_validation_error
from shared.errors import LorafleetError


def create_app(ctx: GatewayContext) -> FastAPI:
    app = FastAPI(title="lorafleet gateway", version="0.1.0",
                  description="OpenAI-compatible multi-tenant multi-LoRA inference API")
    app.state.ctx = ctx
    app.add_exception_handler(LorafleetError, on_lorafleet_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_middleware(BodyLimit, max_bytes=ctx.settings.max_body_bytes)
    app.include_router(completions_router)

    @app.get("/metrics", include_in_schema=False)
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        ctx_: GatewayContext = request.app.state.ctx
        ready, components = ctx_.cluster.status()
        components["nats"] = "ok" if ctx_.nc.is_connected else "disconnected"
        ready = ready and ctx_.nc.is_connected
        return JSONResponse({"ready": ready, "components": components}, status_code=200 if ready else 503)

    return app
