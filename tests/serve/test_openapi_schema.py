"""app/serve/api/openapi_schema.py: the OpenAI routes' bodies in /openapi.json (no cluster)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel

from app.serve.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from app.serve.api.openapi_schema import inline_refs


def test_the_served_schema_documents_both_bodies_without_dangling_refs():
    """Seen failing before the routes' openapi_extra: no requestBody at all."""
    from app.serve.ingress import api

    doc = api.openapi()
    text = json.dumps(doc)
    assert "$ref" not in text and "$defs" not in text  # '#' would be the document's root
    for path, model in (
        ("/v1/completions", CompletionRequest),
        ("/v1/chat/completions", ChatCompletionRequest),
    ):
        op = doc["paths"][path]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert set(schema["required"]) == {
            n for n, f in model.model_fields.items() if f.is_required()
        }
        assert {"200", "400", "404", "413", "429", "503"} <= set(op["responses"])
    # A body the server takes fits the documented schema; one it refuses does not.
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    jsonschema.validate(body, chat["application/json"]["schema"])
    ChatCompletionRequest.model_validate(body)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body | {"temperature": 3}, chat["application/json"]["schema"])


class _Node(BaseModel):
    children: list[_Node] = []


def test_a_recursive_model_is_refused_not_inlined_forever():
    with pytest.raises(ValueError, match="recursive schema through _Node"):
        inline_refs(_Node.model_json_schema())
