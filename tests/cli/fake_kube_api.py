"""FAKE Kubernetes API server (no kube-apiserver can run on these machines): serves just the endpoints
`k3 scale --kube` and the Kubernetes drills use, from an in-memory object store, and records every call so
tests can assert what the official `kubernetes` client sent."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


def _matches(labels: dict, selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class FakeKubeApi:
    def __init__(self, objects: dict[str, list[dict]]):
        # objects: plural ("deployments", "statefulsets", "pods", "networkpolicies") -> list of objects
        self.objects = objects
        self.calls: list[tuple[str, str, dict | None]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict | None:
                length = int(self.headers.get("content-length") or 0)
                return json.loads(self.rfile.read(length)) if length else None

            def do_GET(self):
                url = urlparse(self.path)
                api.calls.append(("GET", url.path, None))
                plural = url.path.rstrip("/").rsplit("/", 1)[-1]
                selector = parse_qs(url.query).get("labelSelector", [""])[0]
                items = [o for o in api.objects.get(plural, []) if _matches(o["metadata"].get("labels", {}), selector)]
                self._reply(200, {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": items})

            def do_PATCH(self):
                body = self._body()
                api.calls.append(("PATCH", self.path, body))
                parts = self.path.split("/")
                plural, name = parts[-3], parts[-2]
                for obj in api.objects.get(plural, []):
                    if obj["metadata"]["name"] == name:
                        obj["spec"]["replicas"] = body["spec"]["replicas"]
                        self._reply(200, {"kind": "Scale", "apiVersion": "autoscaling/v1",
                                          "metadata": {"name": name}, "spec": body["spec"]})
                        return
                self._reply(404, {"kind": "Status", "code": 404, "message": "not found"})

            def do_DELETE(self):
                api.calls.append(("DELETE", self.path, self._body()))
                parts = urlparse(self.path).path.split("/")
                plural, name = parts[-2], parts[-1]
                found = [o for o in api.objects.get(plural, []) if o["metadata"]["name"] == name]
                api.objects[plural] = [o for o in api.objects.get(plural, []) if o["metadata"]["name"] != name]
                if found:
                    self._reply(200, found[0])
                else:
                    self._reply(404, {"kind": "Status", "code": 404, "message": "not found"})

            def do_POST(self):
                body = self._body()
                api.calls.append(("POST", self.path, body))
                plural = self.path.rstrip("/").rsplit("/", 1)[-1]
                api.objects.setdefault(plural, []).append(body)
                self._reply(201, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeKubeApi:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
