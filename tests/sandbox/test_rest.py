"""The E2B-compatible REST facade, over real HTTP to the same service process."""

from __future__ import annotations

import httpx
import pytest

from tests.sandbox.conftest import requires_namespace

pytestmark = requires_namespace


@pytest.fixture(scope="module")
def http(rest_address):
    with httpx.Client(base_url=f"http://{rest_address}", headers={"X-Tenant": "t-rest"}, timeout=60) as c:
        yield c


def test_e2b_lifecycle_fork_and_snapshots(http):
    r = http.post("/sandboxes", json={"templateID": "base", "timeout": 300, "envVars": {"GREETING": "hi"}})
    assert r.status_code == 201, r.text
    sbx = r.json()
    sid = sbx["sandboxID"]
    assert sbx["templateID"] == "base" and sbx["state"] == "running" and sbx["clientID"] == "t-rest"

    r = http.post(f"/sandboxes/{sid}/commands", json={"cmd": "echo $GREETING > /home/user/g; cat /home/user/g"})
    assert r.json() == {"stdout": "hi\n", "stderr": "", "exitCode": 0}
    assert http.post(f"/sandboxes/{sid}/pause").status_code == 204
    assert http.get(f"/sandboxes/{sid}").json()["state"] == "paused"
    r = http.post(f"/sandboxes/{sid}/resume", json={"timeout": 600})
    assert r.status_code == 201 and r.json()["state"] == "running" and r.json()["timeout"] == 600

    snap = http.post(f"/sandboxes/{sid}/snapshots").json()["snapshotID"]
    assert http.post(f"/sandboxes/{sid}/files", params={"path": "/home/user/g"}, content=b"changed").status_code == 200
    forks = http.post(f"/sandboxes/{sid}/fork", json={"count": 2}).json()["sandboxes"]
    restored = http.post(f"/snapshots/{snap}/restore").json()
    assert http.get(f"/sandboxes/{restored['sandboxID']}/files", params={"path": "/home/user/g"}).content == b"hi\n"
    for f in forks:
        assert http.get(f"/sandboxes/{f['sandboxID']}/files", params={"path": "/home/user/g"}).content == b"changed"
    listed = {s["sandboxID"] for s in http.get("/sandboxes").json()}
    assert listed == {sid, restored["sandboxID"], *(f["sandboxID"] for f in forks)}

    for s in listed:
        assert http.delete(f"/sandboxes/{s}").status_code == 204
    assert http.delete(f"/snapshots/{snap}").status_code == 204
    assert http.get("/sandboxes").json() == []


def test_e2b_api_key_is_a_tenant_without_being_shown(rest_address):
    with httpx.Client(base_url=f"http://{rest_address}", headers={"X-API-Key": "e2b_secret"}, timeout=60) as c:
        sbx = c.post("/sandboxes", json={}).json()
        assert sbx["clientID"].startswith("key-") and "secret" not in sbx["clientID"]
        assert [s["sandboxID"] for s in c.get("/sandboxes").json()] == [sbx["sandboxID"]]
        assert c.delete(f"/sandboxes/{sbx['sandboxID']}").status_code == 204


def test_rest_errors_are_json_with_http_status(http):
    r = http.get("/sandboxes/sbx-missing")
    assert r.status_code == 404 and "sbx-missing" in r.json()["message"]
    r = http.post("/sandboxes", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "body" in r.json()["message"]
    r = http.post("/sandboxes", json={"timeout": -5})
    assert r.status_code == 400 and "timeout" in r.json()["message"]
    r = http.post("/sandboxes", json={"memoryMB": 1 << 30})
    assert r.status_code == 400 and "limits.memory_bytes" in r.json()["message"]
    r = http.post("/sandboxes", json={"envVars": ["A=1"]})
    assert r.status_code == 400 and "envVars" in r.json()["message"]
    sid = http.post("/sandboxes", json={}).json()["sandboxID"]
    r = http.post(f"/sandboxes/{sid}/commands", json={"cmd": []})
    assert r.status_code == 400 and "cmd" in r.json()["message"]
    r = http.post(f"/sandboxes/{sid}/commands", json={"cmd": "true", "envs": {"N": 1}})
    assert r.status_code == 400 and "envs" in r.json()["message"]
    r = http.post(f"/sandboxes/{sid}/files", params={"path": "/tmp/f"}, content=b"not base64!",
                  headers={"Content-Transfer-Encoding": "base64"})
    assert r.status_code == 400 and "base64" in r.json()["message"]
    r = http.post(f"/sandboxes/{sid}/files", params={"path": "/tmp/f"}, content=b"aGk=",
                  headers={"Content-Transfer-Encoding": "base64"})
    assert r.json() == {"path": "/tmp/f", "size": 2}
    assert http.get(f"/sandboxes/{sid}/files", params={"path": "/tmp/f"}).content == b"hi"
    # A bad body is refused before anything happens: the paused sandbox stays paused.
    assert http.post(f"/sandboxes/{sid}/pause").status_code == 204
    r = http.post(f"/sandboxes/{sid}/resume", json={"timeout": "soon"})
    assert r.status_code == 400 and "timeout" in r.json()["message"]
    assert http.get(f"/sandboxes/{sid}").json()["state"] == "paused"
    r = http.post("/snapshots/snap-missing/restore")
    assert r.status_code == 404
    http.delete(f"/sandboxes/{sid}")
