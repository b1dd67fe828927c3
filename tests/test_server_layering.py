"""The server package never imports torch; the OpenAPI schema describes the real routes."""

import subprocess
import sys

from fastapi.testclient import TestClient

from gptoss_serve.config import ServerConfig
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import ScriptedEngine


def test_server_does_not_import_torch() -> None:
    code = "import sys, gptoss_serve.server.app; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_openapi_schema_lists_the_routes_and_models() -> None:
    app = create_app(ScriptedEngine(), ResponseStore(":memory:"), ServerConfig())
    with TestClient(app) as client:
        schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    assert set(paths["/v1/responses"]) == {"post"}
    assert set(paths["/v1/responses/{response_id}"]) == {"get", "delete"}
    for path in ("/v1/responses/{response_id}/input_items", "/v1/models", "/health"):
        assert "get" in paths[path]
    assert set(paths["/v1/chat/completions"]) == {"post"}
    assert set(paths["/v1/conversations/{conversation_id}"]) == {"get", "post", "delete"}
    assert set(paths["/v1/conversations/{conversation_id}/items"]) == {"get", "post"}
    assert set(paths["/v1/conversations/{conversation_id}/items/{item_id}"]) == {"get", "delete"}
    post = paths["/v1/responses"]["post"]
    assert "text/event-stream" in post["responses"]["200"]["content"]
    assert "400" in post["responses"] and "404" in post["responses"]
    components = schema["components"]["schemas"]
    for name in ("CreateResponseRequest", "ResponseObject", "ErrorResponse", "Usage"):
        assert name in components
    assert "schema" in components["TextFormatJsonSchema"]["properties"]  # the wire name
