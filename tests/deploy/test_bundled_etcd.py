"""The bundled etcd's rendered command line starts a real etcd whose readiness endpoint reports healthy.

Hostnames and ports are rewritten to loopback and free ports (the pod's DNS does not exist here); every flag
is passed to the real /usr/bin/etcd as rendered.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request

from services.runtime.ports import free_port
from tests.deploy.chart import MINIMAL, container, of_kind, render


def test_rendered_etcd_command_runs_and_turns_ready(tmp_path):
    etcd_binary = shutil.which("etcd")
    assert etcd_binary, "etcd missing: apt-get install etcd-server (.ci/setup does)"
    statefulset = of_kind(render({**MINIMAL, "etcd": {"bundled": {"replicas": 1}}}), "StatefulSet")["etcd"]
    spec = container(statefulset)
    ports = {p["name"]: (p["containerPort"], free_port()) for p in spec["ports"]}
    command = []
    for arg in spec["command"][1:]:
        arg = arg.replace("$(POD_NAME).k3-etcd-headless.serve.svc", "127.0.0.1")
        arg = arg.replace("k3-etcd-0.k3-etcd-headless.serve.svc", "127.0.0.1").replace("$(POD_NAME)", "k3-etcd-0")
        arg = arg.replace("0.0.0.0", "127.0.0.1").replace("/var/lib/etcd", str(tmp_path))
        for pod_port, local_port in ports.values():
            arg = arg.replace(f":{pod_port}", f":{local_port}")
        command.append(arg)
    probe = spec["readinessProbe"]["httpGet"]
    url = f"http://127.0.0.1:{ports[probe['port']][1]}{probe['path']}"
    process = subprocess.Popen([etcd_binary, *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, health = time.monotonic() + 20, None
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=1) as reply:
                    health = json.loads(reply.read())
                break
            except OSError:
                time.sleep(0.2)
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        assert health is not None and health["health"] == "true", health
    finally:
        process.kill()
        process.wait(timeout=10)
