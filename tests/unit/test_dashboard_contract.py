"""The HTTP API's contract with its clients, in process (FastAPI's TestClient): request bodies are
strict JSON (NaN and infinity are a 422 naming the field, on every POST route that takes a body),
and /openapi.json declares the token scheme and the answers' shapes."""

from __future__ import annotations

import json

import pytest

from psflow.platform.jsonbody import NonFiniteNumberError, loads_finite

TOKEN = "contract-token-0123456789"


@pytest.fixture
def client(tmp_path):  # noqa: ANN201
    from fastapi.testclient import TestClient

    from psflow.platform.api import UiSettings, create_app

    app = create_app(UiSettings(home=tmp_path, token=TOKEN, script_roots=(tmp_path,), runs_root=tmp_path / "runs"))
    return TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False,
                      headers={"Authorization": f"Bearer {TOKEN}"})


def _post_routes_with_a_body(client) -> list[str]:  # noqa: ANN001
    paths = client.get("/openapi.json").json()["paths"]
    return sorted(p for p, ops in paths.items() if "requestBody" in ops.get("post", {}))


# each POST route that takes a body, a body it would accept but for one non-finite number
BODIES = {
    "/api/runs": ('{"script": "x.py", "args": [], "workers": %s}', "workers"),
    "/api/runs/{run_id}/scale": ('{"workers": %s}', "workers"),
    "/api/runs/{run_id}/restart": ('{"nodes": %s}', "nodes"),
}


def test_strict_json_refuses_nan_and_infinity_and_names_where():
    assert loads_finite('{"lr": 0.5, "n": [1, 2.5e300], "s": "NaN"}') == {"lr": 0.5, "n": [1, 2.5e300], "s": "NaN"}
    with pytest.raises(NonFiniteNumberError) as e:
        loads_finite('{"lr": NaN, "opt": {"betas": [0.9, -Infinity]}, "big": 1e999, "small": -1e999}')
    assert e.value.fields == [["body", "lr"], ["body", "opt", "betas", 1], ["body", "big"], ["body", "small"]]
    assert e.value.texts == ["NaN", "-Infinity", "1e999", "-1e999"]
    with pytest.raises(json.JSONDecodeError):
        loads_finite("{nope")


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_non_finite_number_in_any_body_is_a_422_naming_the_field(client, number):
    assert set(BODIES) == set(_post_routes_with_a_body(client)), "a POST route with a body has no case here"
    for path, (template, field) in BODIES.items():
        r = client.post(path.replace("{run_id}", "run-x"), content=template % number,
                        headers={"Content-Type": "application/json"})
        assert r.status_code == 422, (path, r.status_code, r.text)
        (detail,) = r.json()["detail"]
        assert detail["loc"] == ["body", field] and detail["input"] == number, detail
        assert detail["msg"] == (f"{field} is {number}, which is not a JSON number: give a finite number "
                                 "(NaN and infinity are refused)")
    # without a content type FastAPI reads the body as JSON too: the same answer
    r = client.post("/api/runs/run-x/scale", content='{"workers": NaN}')
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "workers"]


def test_a_body_that_is_not_json_at_all_keeps_fastapis_own_422(client):
    r = client.post("/api/runs/run-x/scale", content="{nope", headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"


def _schema(tmp_path, *, auth_reads: bool) -> dict:
    from fastapi.testclient import TestClient

    from psflow.platform.api import UiSettings, create_app

    app = create_app(UiSettings(home=tmp_path, token=TOKEN, auth_reads=auth_reads))
    return TestClient(app, base_url="http://127.0.0.1").get("/openapi.json").json()


def test_the_openapi_document_declares_the_token_on_the_routes_that_need_it(tmp_path):
    local = _schema(tmp_path, auth_reads=False)
    schemes = local["components"]["securitySchemes"]
    assert schemes["token"] == {"type": "http", "scheme": "bearer", "description": schemes["token"]["description"]}
    assert schemes["token_header"]["in"] == "header" and schemes["token_header"]["name"] == "X-Psflow-Token"
    token = [{"token": []}, {"token_header": []}]
    for path, ops in local["paths"].items():
        for method, op in ops.items():
            if path == "/api/health":
                assert "security" not in op  # open to any request the Host allowlist admits
            elif method == "post":
                assert op["security"] == token, (method, path)
            else:  # a read: the token, or nothing on a loopback dashboard
                assert op["security"] == [*token, {}], (method, path)
    remote = _schema(tmp_path, auth_reads=True)
    for path, ops in remote["paths"].items():
        for method, op in ops.items():
            assert path == "/api/health" or op["security"] == token, (method, path)


def test_the_openapi_document_types_the_main_answers(tmp_path):
    doc = _schema(tmp_path, auth_reads=False)
    schemas = doc["components"]["schemas"]

    def answer(method: str, path: str) -> dict:
        responses = doc["paths"][path][method]["responses"]
        (ok,) = [v for k, v in responses.items() if k.startswith("2")]
        ref = ok["content"]["application/json"]["schema"]["$ref"]
        return schemas[ref.rsplit("/", 1)[1]]

    assert {"runs", "total", "limit", "offset"} <= set(answer("get", "/api/runs")["properties"])
    row = schemas["RunRow"]["properties"]
    assert {"id", "state", "script", "args", "logdir", "backend", "tasks", "loss"} <= set(row)
    assert row["state"]["enum"] == ["pending", "running", "succeeded", "failed", "stopped", "abandoned"]
    assert set(answer("get", "/api/runs/{run_id}")["properties"]) == {"run", "attempts", "events", "controls"}
    assert "failure" in schemas["RunOnPage"]["properties"]
    for path in ("/api/runs", "/api/runs/{run_id}/restart", "/api/runs/{run_id}/checkpoints/{name}/restore"):
        assert {"run_id", "logdir"} <= set(answer("post", path)["required"]), path
    assert set(answer("post", "/api/runs/{run_id}/scale")["required"]) == {"run_id", "request_id", "workers"}
    for path in ("/api/runs/{run_id}/stop", "/api/runs/{run_id}/dump"):
        assert set(answer("post", path)["required"]) == {"run_id", "request_id"}, path
    assert set(answer("get", "/api/health")["required"]) == {"ok", "job_store"}
    assert set(answer("get", "/api/summary")["required"]) == {"runs", "by_state"}
    assert set(answer("get", "/api/runs/{run_id}/summary")["required"]) == {"run_id", "state", "summary"}
