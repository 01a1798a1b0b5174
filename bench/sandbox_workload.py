"""The small stateful workload the sandbox tests and benchmark run: a counter held in a Python process's
memory, mirrored into a file in the sandbox's root, bumped over a Unix socket."""

COUNTER_PY = b"""
import os, socket
n = 0
path = "/tmp/counter.sock"
if os.path.exists(path):
    os.unlink(path)
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen(16)
while True:
    conn, _ = server.accept()
    n += 1
    with open("/home/user/count.txt", "w") as f:
        f.write(str(n))
    conn.sendall(str(n).encode())
    conn.close()
"""
BUMP = ["python3", "-c", "import socket; s = socket.socket(socket.AF_UNIX); s.connect('/tmp/counter.sock'); "
        "print(s.recv(64).decode())"]
