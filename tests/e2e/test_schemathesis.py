"""A bounded schemathesis run over the OpenAPI documents of a served router and worker: every
documented operation gets schema-valid and schema-violating requests; none may answer 5xx, and
every answer must match the document (status documented, content type, body schema).

Half of the generated completion bodies name the served model (random names only reach the
404), so generation, limits and the worker hop are exercised too. Hypothesis is derandomized
(seeded by the test) and bounded (examples per operation and mode), well under a minute of
requests on CI."""

from __future__ import annotations

import itertools

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance,
                                               response_schema_conformance,
                                               status_code_conformance)

from tests.e2e.conftest import MODEL, SECRET_HEADER, http

# conftest: one deployment for these modules; its baseline worker is a gen worker without a KV
# source: fuzzed generation_only params are served by recomputing the prompt, never by dialling
# whatever ctx endpoint they name
SHARED_DEPLOYMENT = "disagg"

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
MAX_EXAMPLES = 12  # per operation and generation mode


def _run(url: str, headers: dict[str, str]) -> list[str]:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers)
    session = requests.Session()
    session.headers.update(headers)
    names = itertools.count()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions",
                                              "/v1/models", "/health", "/metrics"}
    seen: list[str] = []
    for op in operations:
        has_body = op.method.upper() == "POST"  # nothing to violate in a parameterless GET
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body \
            else (GenerationMode.POSITIVE,)
        for mode in modes:
            @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case) -> None:  # noqa: ANN001 (a schemathesis Case)
                if isinstance(case.body, dict) and "model" in case.body and next(names) % 2:
                    case.body["model"] = MODEL
                response = case.call_and_validate(checks=CHECKS, session=session, timeout=60)
                seen.append(f"{case.method} {case.path} {response.status_code}")

            check()
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("role", ["router", "worker"])
def test_schemathesis_finds_no_5xx_and_no_undocumented_answer(dep, role):
    # a worker is called as the router calls it: with the deployment's internal secret
    url, headers = ((dep.router_url, {}) if role == "router"
                    else (dep.baseline_url, {SECRET_HEADER: dep.secret}))
    seen = _run(url, headers)
    assert any(line.endswith(" 200") and "completions" in line for line in seen), seen
    assert http("GET", f"{url}/health")[0] == 200
