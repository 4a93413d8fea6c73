"""Every error the gateway answers, in OpenAI's error JSON, from one mapping."""

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared import metrics
from shared.errors import LorafleetError


def error_json(status: int, message: str, error_type: str, code: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def error_payload(err: LorafleetError) -> dict:
    return {"error": {"message": err.message, "type": err.error_type, "param": err.param, "code": err.code}}


def lorafleet_error_response(err: LorafleetError) -> JSONResponse:
    response = JSONResponse(error_payload(err), status_code=err.status)
    if err.retry_after_s is not None:
        response.headers["Retry-After"] = str(max(1, round(err.retry_after_s)))
    return response


async def on_lorafleet_error(_: Request, err: LorafleetError) -> JSONResponse:
    metrics.ADMISSION_REJECTIONS.labels(err.code).inc()
    return lorafleet_error_response(err)


async def on_validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
    first = err.errors()[0] if err.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return error_json(400, "request body is not valid JSON", "invalid_request_error", "invalid_json")
    if first.get("type") == "extra_forbidden":
        message = f"unsupported parameter: {param}"
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
    return error_json(400, message, "invalid_request_error", "invalid_request", param)


async def on_http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
    codes = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}
    code = codes.get(err.status_code, "http_error")  # 400: a body FastAPI could not parse (e.g. nested too deep)
    return error_json(err.status_code, str(err.detail), "invalid_request_error", code)
