"""Exec over gRPC: output streams while the command runs, stdout/stderr/exit code/stdin/env/cwd are exact."""

from __future__ import annotations

import pytest

from k3.v1 import sandbox_pb2 as pb
from tests.sandbox.conftest import requires_criu, requires_namespace

pytestmark = requires_namespace


def test_output_streams_before_the_command_ends(client):
    sid = client.create().sandbox_id
    # The command cannot finish until the test, having seen its first line, creates /tmp/go: a buffered
    # (non-streaming) exec would deadlock here and end at its timeout with exit 124 instead.
    script = "echo first; while [ ! -f /tmp/go ]; do sleep 0.05; done; echo second >&2; exit 7"
    stream = client.stub.Exec(pb.ExecRequest(sandbox_id=sid, argv=["sh", "-c", script], timeout_s=20))
    first = next(stream)
    assert first.stdout == b"first\n" and not first.exited
    client.stub.WriteFile(pb.WriteFileRequest(sandbox_id=sid, path="/tmp/go", data=b""))
    rest = list(stream)
    assert b"".join(m.stderr for m in rest) == b"second\n"
    assert rest[-1].exited and rest[-1].exit_code == 7
    client.destroy(sid)


@pytest.mark.parametrize("backend", ["namespace", pytest.param("criu", marks=requires_criu)])
def test_stdin_env_cwd_and_binary_output(client, backend):
    sid = client.create(backend=backend, env={"SANDBOX_WIDE": "a"}).sandbox_id
    payload = bytes(range(256)) * 64
    msgs = list(client.stub.Exec(pb.ExecRequest(sandbox_id=sid, argv=["cat"], stdin=payload)))
    assert b"".join(m.stdout for m in msgs) == payload and msgs[-1].exit_code == 0
    code, out, _ = client.run(sid, ["sh", "-c", "echo $SANDBOX_WIDE $PER_CALL $(pwd) $(id -u)"],
                              env={"PER_CALL": "b"}, cwd="/tmp")
    assert (code, out) == (0, "a b /tmp 1000\n")
    assert client.sh(sid, "pwd")[1] == "/home/user\n"  # a request without cwd starts in the user's home
    code, _, err = client.run(sid, ["no-such-program"])
    assert code == 127 and "no-such-program" in err
    client.destroy(sid)
