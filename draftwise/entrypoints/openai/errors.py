"""Errors of the OpenAI-compatible server in OpenAI's shape: `{"error": {message, type, param,
code}}`. Every malformed request becomes a 4xx naming the field, never a 500: pydantic's
validation errors map to 400s, Starlette's HTTP errors keep their status."""
from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftwise.entrypoints.openai import protocol as P


class APIError(Exception):
    """An error returned to the client in OpenAI's shape."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_dict(self) -> dict:
        """Plain fields (crosses process boundaries; `from_dict` rebuilds it)."""
        return {"message": self.message, "status": self.status, "param": self.param, "code": self.code,
                "type": self.type}

    @classmethod
    def from_dict(cls, d: dict) -> "APIError":
        return cls(d["message"], d["status"], d.get("param"), d.get("code"), d.get("type", "invalid_request_error"))


ERRORS = {code: {"model": P.ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}
_TYPE_ERRORS = ("int_type", "string_type", "bool_type", "float_type", "list_type", "dict_type", "model_type",
                "int_parsing", "float_parsing", "literal_error", "model_attributes_type", "union_tag_invalid")


def error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if err.status in (429, 503) else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic error of a request body as an OpenAI-style 400 naming the field."""
    e = errors[0] if errors else {"type": "value_error", "loc": ("body",), "msg": "invalid request"}
    parts = []
    for p in e.get("loc", ())[1:]:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif isinstance(p, str) and p.isidentifier() and p not in ("str", "int", "float", "bool", "list", "dict"):
            parts.append(("." if parts else "") + p)
    param = "".join(parts) or None
    kind = e.get("type", "")
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "json_invalid":
        return APIError(f"We could not parse the JSON body of your request ({e.get('ctx', {}).get('error', msg)}).",
                        code="invalid_json")
    if param is None:
        return APIError("the request body must be a JSON object" if kind in _TYPE_ERRORS or kind == "missing"
                        else msg, code="invalid_json" if kind in _TYPE_ERRORS else "invalid_value")
    if kind == "missing":
        return APIError(f"you must provide '{param}'", param=param, code="missing_required_parameter")
    code = "invalid_type" if kind in _TYPE_ERRORS else "invalid_value"
    return APIError(f"'{param}': {msg}", param=param, code=code)


def install_error_handlers(app, metrics) -> None:
    """APIError, pydantic validation errors and Starlette HTTP errors, all in OpenAI's shape."""
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        metrics.requests.labels(outcome="rejected").inc()
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        err = APIError(str(exc.detail), exc.status_code, code="not_found" if exc.status_code == 404 else None)
        return error_response(err)
