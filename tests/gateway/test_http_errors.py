"""Bad input at the front door gets a clear OpenAI-format 4xx and disturbs nothing (real gateway process)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from services.cli.health_cmd import check
from tests.support.processes import ServiceProcess


def post(address: str, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{address}{path}", data,
                                     {"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    proc = ServiceProcess(["serve", "gateway", "--port", "0", "--http-port", "0", "--metrics-port", "-1",
                           "--max-prompt-tokens", "64", "--max-output-tokens", "100", "--route-wait-s", "0.5"],
                          tmp_path_factory.mktemp("gateway"))
    proc.start()
    yield proc
    proc.kill()


CHAT = {"model": "nano", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("body,status,param,code", [
    (b"{not json", 400, None, None),
    (b"[1, 2]", 400, None, None),
    ({**CHAT, "model": "gpt-9"}, 404, "model", "model_not_found"),
    ({**CHAT, "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ({**CHAT, "max_tokens": 101}, 400, "max_tokens", "invalid_value"),
    ({**CHAT, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ({**CHAT, "messages": []}, 400, "messages", "invalid_value"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    ({**CHAT, "messages": [{"role": "user", "content": "x" * 500}]}, 400, "messages", "context_length_exceeded"),
    ({**CHAT, "reasoning_effort": "extreme"}, 400, "reasoning_effort", "invalid_value"),
])
def test_bad_requests_get_clear_4xx(gateway, body, status, param, code):
    http = gateway.info["http_address"]
    got_status, got = post(http, "/v1/chat/completions", body)
    assert got_status == status, got
    error = got["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    if code:
        assert error["code"] == code


def test_nothing_disturbed_and_no_backend_is_503(gateway):
    http = gateway.info["http_address"]
    for _ in range(3):
        post(http, "/v1/chat/completions", b"{bad")
    assert check(gateway.address) == "SERVING"
    with urllib.request.urlopen(f"http://{http}/v1/models", timeout=10) as reply:
        assert json.loads(reply.read())["data"][0]["id"] == "nano"
    status, body = post(http, "/v1/completions", {"model": "nano", "prompt": "hello", "max_tokens": 2})
    assert status == 503 and body["error"]["type"] == "server_error"
    assert "router" in body["error"]["message"]
