"""schemathesis against a served app's own `/openapi.json` (docs/reliability.md, fuzz).

The schema documents each OpenAI route's body (app/serve/api/openapi_schema.py), so schemathesis
generates bodies that fit it (positive) and bodies that break it (negative). Each answer must
pass schemathesis's checks (no 5xx, a documented status and content type, error JSON of the
documented shape, invalid bodies refused with a 4xx) and ours: a 4xx is OpenAI error JSON, a
200 stream carries no `server_error` event. 3 in 4 bodies get the served model's name, so
they reach the engine; generation is capped at 4 tokens and 2 choices to keep volume cheap.
"""

from __future__ import annotations

import json
from collections import Counter

import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from reliability.serve.fuzzing import fuzz

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
CAPS = {"max_tokens": 4, "n": 2}


def _cheap(case, model: str | None) -> None:
    """The served model's name (unless `model` is None) and capped generation, in place.
    Only values above a cap are lowered, so an invalid (negative) value stays invalid."""
    body = case.body
    if not isinstance(body, dict):
        return
    if model is not None and isinstance(body.get("model"), str):
        body["model"] = model
    for name, cap in CAPS.items():
        value = body.get(name)
        if type(value) is int and value > cap:
            body[name] = cap


def _check(url: str, model: str, tally: Counter, mode: GenerationMode):
    def check(drawn) -> None:
        case, draw = drawn
        _cheap(case, model if draw else None)  # 3 in 4 name the served model
        response = case.call(base_url=url, timeout=120)
        status = response.status_code
        tally[(mode.value, case.operation.label, status)] += 1
        case.validate_response(response, checks=CHECKS)
        text = response.text
        if status >= 400:
            message = json.loads(text)["error"]["message"]
            tally[f"why: {message[:48]}"] += 1
        else:
            assert '"server_error"' not in text, (text[:300], case.body)

    return check


def schema_fuzz(url: str, model: str, examples: int, seed: int = 0) -> Counter:
    """`examples` positive and `examples` negative cases over every operation of the app's
    schema -> tally of (mode, operation, status) and of 4xx reasons."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    tally: Counter = Counter()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        cases = st.tuples(schema.as_strategy(generation_mode=mode), st.integers(0, 3))
        fuzz(cases, _check(url, model, tally, mode), examples, seed)
    return tally
