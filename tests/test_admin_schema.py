"""schemathesis over the admin API's /openapi.json: generated requests for every operation,
with no server errors and responses that match the schema."""

from __future__ import annotations

from types import SimpleNamespace

import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings

from kvtier.api.admin import History, build_app
from kvtier.api.metrics import Metrics
from tests.conftest import blocks, keys

TOKEN = "schema-token"


def test_admin_api_conforms_to_its_schema(make_engine):
    eng = make_engine()
    eng.create_namespace("m", 4096)
    eng.put("m", keys(range(4)), blocks(4, 4096))
    metrics = Metrics()
    metrics.bind(eng.stats)
    history = History()
    history.add(eng.stats())
    server = SimpleNamespace(clients={}, stats=eng.stats)
    app = build_app(eng, server, eng.settings, metrics, history, TOKEN)
    TestClient(app)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 11
    tried = []
    for op in operations:
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)
        @given(case=op.as_strategy())
        def run(case):
            case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"})
            tried.append(case.path)

        run()
    assert len(set(tried)) == len(operations)
