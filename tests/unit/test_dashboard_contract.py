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
