"""The admin REST API: FastAPI's test client, a real `kvtier serve`, Prometheus parsing,
schemathesis over /openapi.json, and a headless Chromium that watches the dashboard draw."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import kvtier
from kvtier.api.admin import History, build_app, check_admin_binding
from kvtier.api.metrics import Metrics
from kvtier.config import make_settings
from kvtier.errors import ConfigError
from tests.conftest import blocks, key, keys
from tests.service import Service

TOKEN = "s3cret-token"


@pytest.fixture
def app_and_engine(make_engine):
    eng = make_engine()
    eng.create_namespace("m/tp0", 4096)
    eng.put("m/tp0", keys(range(3)), blocks(3, 4096), parents=bytes(16) + keys(range(2)))
    eng.read("m/tp0", keys(range(4)))
    metrics = Metrics()
    metrics.bind(eng.stats)
    metrics.observe("get", 0.0002, True)
    metrics.observe("get", 0.004, False)
    history = History()
    history.add(eng.stats())
    server = SimpleNamespace(clients={}, stats=eng.stats)
    app = build_app(eng, server, eng.settings, metrics, history, TOKEN)
    return TestClient(app), eng


def test_health_stats_namespaces_and_blocks(app_and_engine):
    client, eng = app_and_engine
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200
    s = client.get("/v1/stats").json()
    host = s["tiers"]["host"]
    for field in ("capacity_bytes", "used_bytes", "blocks", "hits", "misses", "promotions",
                  "demotions", "evictions", "bytes_read", "bytes_written", "read_bps",
                  "write_bps"):
        assert field in host
    assert host["blocks"] == 3 and s["gets"] == 4 and s["get_hits"] == 3
    assert s["hit_ratio"] == pytest.approx(0.75)
    assert s["ops"]["get"]["count"] == 2 and s["checksum_failures"] == 0
    assert [n["name"] for n in client.get("/v1/namespaces").json()] == ["m/tp0"]
    b = client.get(f"/v1/blocks/m/tp0/{key(1).hex()}").json()
    assert b["version"] == 1 and b["parent"] == key(0).hex() and b["children"] == [key(2).hex()]
    assert b["copies"]["host"]["current"] == 1 and b["copies"]["nvme"]["version"] == 1
    assert client.get(f"/v1/blocks/m/tp0/{key(9).hex()}").status_code == 404
    assert client.get("/v1/blocks/m/tp0/zz").status_code == 422
    assert client.get(f"/v1/blocks/nope/{key(1).hex()}").status_code == 404
    assert client.get("/v1/blocks/m/tp0/abcd").status_code == 404       # wrong key width


def test_mutations_need_the_bearer_token(app_and_engine):
    client, eng = app_and_engine
    assert client.post("/v1/flush").status_code == 401
    assert client.post("/v1/flush", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.post("/v1/flush", headers={"Authorization": TOKEN}).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert client.post("/v1/flush", headers=auth).json() == {"flushed": 0}
    r = client.post("/v1/evict", headers=auth, json={"tier": "host", "count": 2})
    assert r.json() == {"evicted": 2}
    assert eng.stats()["tiers"]["host"]["blocks"] == 1
    assert client.post("/v1/evict", headers=auth, json={"tier": "disk"}).status_code == 422
    assert client.post("/v1/evict", headers=auth, json={"count": -1}).status_code == 422
    assert client.post("/v1/evict", headers=auth, content=b"\xff garbage").status_code == 422


def test_metrics_parse_back_with_prometheus_client(app_and_engine):
    client, _ = app_and_engine
    text = client.get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    hist = fams["kvtier_op_duration_seconds"]
    assert hist.type == "histogram"
    count = [s for s in hist.samples if s.name.endswith("_count") and s.labels["op"] == "get"]
    assert count[0].value == 2
    assert fams["kvtier_op_errors"].samples[0].value == 1
    blocks_ = {s.labels["tier"]: s.value for s in fams["kvtier_tier_blocks"].samples}
    assert blocks_["host"] == 3
    hits = {s.labels["tier"]: s.value for s in fams["kvtier_tier_hits"].samples}
    assert hits["host"] == 3
    assert fams["kvtier_hit_ratio"].samples[0].value == pytest.approx(0.75)


def test_dashboard_and_its_assets_ship_in_the_package(app_and_engine):
    client, _ = app_and_engine
    page = client.get("/").text
    assert "/static/dashboard.js" in page and "cdn" not in page.lower()
    assert "drawLatency" in client.get("/static/dashboard.js").text
    assert client.get("/static/../admin.py").status_code == 404
    assert client.get("/static/secrets.txt").status_code == 404


def test_binding_beyond_loopback_without_a_token_is_refused(tmp_path: Path):
    s = make_settings({"data_dir": str(tmp_path), "admin": "0.0.0.0:8787"})
    with pytest.raises(ConfigError, match="admin_token"):
        check_admin_binding(s)
    check_admin_binding(s.replace(admin_token="x"))
    check_admin_binding(s.replace(admin="127.0.0.1:8787"))
    svc = Service(tmp_path / "svc", admin=False)
    svc.port = 1
    svc.settings["admin"] = "0.0.0.0:18999"
    with pytest.raises(RuntimeError, match="admin_token"):
        svc.start()


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_against_a_real_service_with_clients(service):
    with kvtier.Client(service.socket, name="worker-a") as c:
        ns = c.namespace("m", block_bytes=4096)
        ns.put(keys(range(8)), blocks(8, 4096))
        for _ in range(20):
            ns.get(keys(range(8)))
        rows = _get(service.url + "/v1/clients")
        assert rows[0]["name"] == "worker-a" and rows[0]["qps"] > 0
        assert set(rows[0]) >= {"qps", "p99_ms", "error_rate", "load_weight"}
        s = _get(service.url + "/v1/stats")
        assert s["tiers"]["host"]["hits"] >= 160 and s["ops"]["get"]["count"] >= 20
    token = (service.data_dir / "admin.token").read_text().strip()
    req = urllib.request.Request(service.url + "/v1/flush", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 401
    err.value.close()
    req.add_header("Authorization", f"Bearer {token}")
    assert json.loads(urllib.request.urlopen(req, timeout=10).read()) == {"flushed": 0}
    assert _get(service.url + "/readyz") == {"ready": True}


def test_kvtier_stats_command(service, capsys):
    from kvtier.cli import main
    with kvtier.Client(service.socket) as c:
        c.namespace("m", block_bytes=4096).put(keys([1]), blocks(1, 4096))
    assert main(["stats", "--socket", str(service.socket), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["puts"] == 1
    assert main(["stats", "--url", service.url]) == 0
    assert "host" in capsys.readouterr().out
    assert main(["stats", "--url", "http://127.0.0.1:1"]) == 2


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is installed by make test (tools/system-deps)")
def test_dashboard_draws_real_numbers_in_headless_chromium(service, tmp_path: Path):
    playwright = pytest.importorskip("playwright.sync_api")
    with kvtier.Client(service.socket, name="browser-load") as c:
        ns = c.namespace("m", block_bytes=4096)
        for i in range(30):
            ns.put(keys(range(i * 4, i * 4 + 4)), blocks(4, 4096, i))
            ns.get(keys(range(0, i * 4 + 4)))
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"),
                                        args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(service.url + "/")
            deadline = time.monotonic() + 30
            drawn = "0"
            while time.monotonic() < deadline:
                ns.get(keys(range(8)))
                drawn = page.evaluate("document.body.dataset.drawn || '0'")
                if int(drawn) > 0 and page.inner_text("#kpi-hit") not in ("–", ""):
                    break
                time.sleep(0.2)
            time.sleep(2.5)                       # a few samples for the time series
            assert int(drawn) >= 150
            hit = page.inner_text("#kpi-hit")
            assert hit.endswith("%") and float(hit[:-1]) > 50
            assert page.inner_text("#status") == "live"
            assert "browser-load" in page.inner_text("#clients")
            # the occupancy canvas has coloured pixels (something was drawn)
            painted = page.evaluate("""() => {
                const c = document.getElementById('occupancy');
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; }""")
            assert painted > 1000
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("KVTIER_SCREENSHOT"):        # how docs/dashboard.png is made
                shutil.copy(shot, os.environ["KVTIER_SCREENSHOT"])
            browser.close()
