"""The FastAPI application: routes, error mapping, body limit, health."""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.admin import router as admin_router
from services.gateway.admin_adapters import router as admin_adapters_router
from services.gateway.admin_experiments import router as admin_experiments_router
from services.gateway.admin_routing import router as admin_routing_router
from services.gateway.body_limit import BodyLimit
from services.gateway.completions import router as completions_router
from services.gateway.context import GatewayContext
from services.gateway.dashboard import router as dashboard_router
from services.gateway.errors_http import on_http_error, on_lorafleet_error, on_validation_error
from services.gateway.feedback import router as feedback_router
from shared.errors import LorafleetError, MetricsTokenRequired
from shared.metrics_http import bearer_matches


def create_app(ctx: GatewayContext) -> FastAPI:
    app = FastAPI(
        title="lorafleet gateway",
        version="0.1.0",
        description="OpenAI-compatible multi-tenant multi-LoRA inference API",
    )
    app.state.ctx = ctx
    # Starlette types every handler as taking Exception; it calls each with the class it is registered for
    app.add_exception_handler(LorafleetError, on_lorafleet_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # type: ignore[arg-type]
    app.add_middleware(BodyLimit, max_bytes=ctx.settings.max_body_bytes)
    app.include_router(completions_router)
    app.include_router(feedback_router)
    app.include_router(admin_router)
    app.include_router(admin_adapters_router)
    app.include_router(admin_routing_router)
    app.include_router(admin_experiments_router)
    app.include_router(dashboard_router)

    @app.get("/metrics", include_in_schema=False)
    async def metrics_endpoint(request: Request) -> Response:
        # read per scrape: a rotated token file applies without a restart
        if not bearer_matches(request.headers.get("authorization"), ctx.settings.metrics_bearer()):
            raise MetricsTokenRequired("send 'Authorization: Bearer <LF_METRICS_TOKEN_FILE>'")
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], responses={503: {"description": "a required component is missing"}})
    async def readyz(request: Request) -> JSONResponse:
        ctx_: GatewayContext = request.app.state.ctx
        ready, components = ctx_.cluster.status(catalog_loaded=ctx_.catalog.loaded)
        components["nats"] = "ok" if ctx_.nc.is_connected else "disconnected"
        ready = ready and ctx_.nc.is_connected
        return JSONResponse({"ready": ready, "components": components}, status_code=200 if ready else 503)

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]  # FastAPI's documented override
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document, less its default 422 entries: validation errors are answered 400 here."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for item in schema["paths"].values():
            for operation in item.values():
                operation.get("responses", {}).pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema
