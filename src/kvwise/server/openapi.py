"""The OpenAPI document of `kvwise serve`: request bodies declared from the protocol models.

The handlers read the raw body themselves (size limit, nesting depth and surrogates are checked
before pydantic sees it), so FastAPI cannot infer the bodies; they are declared here instead, so
clients, generators and fuzzers (schemathesis) see what each endpoint takes.
"""

from __future__ import annotations

from fastapi.openapi.utils import get_openapi

from kvwise.server.protocol import ChatRequest, CompletionRequest

BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}
REF = "#/components/schemas/{model}"


def request_body(model) -> dict:
    """`openapi_extra` for a route whose JSON body is `model`."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app) -> None:
    """Make `app.openapi()` include the body models (and the models they refer to) as components."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = document.setdefault("components", {}).setdefault("schemas", {})
            for model in BODIES.values():
                schema = model.model_json_schema(ref_template=REF)
                components.update(schema.pop("$defs", {}))
                components[model.__name__] = schema
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
