"""Leave-running checkpoints of a runc container by CRIU directly, without `runc checkpoint`.

`runc checkpoint` is a Go process that loads the container state, starts one CRIU only to ask its version,
then a second one over RPC to dump: about a third of a snapshot's CPU on this host. The dump it asks for is
fully determined by the bundle, so the backend asks CRIU for the same thing on its command line: the same
root, freezer cgroup, external bind mounts (named by their destination, which is what `runc restore` maps
back to their sources), `descriptors.json` (the init's stdio, which `runc restore` reads), an empty network
namespace (runc never dumps network devices either), plus the options in criu_options. Restores still go
through `runc restore`, which needs to own the new container's state.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
from pathlib import Path

from services.sandbox.backends.criu_options import CLI_LEVEL
from services.sandbox.errors import BackendFailure

# The init's stdio as runc records it: the backend starts runc with all three on /dev/null (a host pipe
# could not be dumped), and only "pipe:" entries would need remapping on restore.
INIT_STDIO = ["/dev/null", "/dev/null", "/dev/null"]
# runc bind-mounts these host device nodes into every container of a user namespace, over the bundle's own.
RUNC_DEVICES = ("/dev/null", "/dev/random", "/dev/full", "/dev/tty", "/dev/zero", "/dev/urandom")
LOG = "dump.log"
DESCRIPTORS = "descriptors.json"


def external_mounts(config: dict, init_pid: int) -> dict[str, str]:
    """Mountpoint -> name in the image, as runc names them: bind mounts by their destination; masked paths
    (files hidden by a bind of /dev/null) as /dev/null."""
    mounts = {m["destination"]: m["destination"] for m in config["mounts"] if m["type"] == "bind"}
    mounts.update({d: d for d in RUNC_DEVICES})
    for path in config["linux"].get("maskedPaths", []):
        if os.path.isfile(f"/proc/{init_pid}/root{path}"):
            mounts[path] = "/dev/null"
    return mounts


def dump_argv(init_pid: int, config: dict, freezer: Path, images: Path, work: Path) -> list[str]:
    argv = ["criu", "dump", "--tree", str(init_pid), "--images-dir", str(images), "--work-dir", str(work),
            "--log-file", LOG, "-v4", "--root", config["root"]["path"], "--leave-running",
            "--freeze-cgroup", str(freezer), "--empty-ns", "net", "--manage-cgroups=ignore"]
    for opt in CLI_LEVEL:
        name, _, value = opt.partition(" ")
        argv += [f"--{name}", value] if value else [f"--{name}"]
    for mountpoint, name in external_mounts(config, init_pid).items():
        argv += ["--external", f"mnt[{mountpoint}]:{name}"]
    return argv


def make_images_dir(images: Path, descriptors_fifo: bool = False) -> None:
    """0700, not runc's 0600: the restorer opens images from inside the container's user namespace.
    `descriptors_fifo`: descriptors.json is a FIFO, which a `runc restore` started early blocks on until
    `feed_descriptors` writes it (runc reads it after its own start-up and just before it starts CRIU)."""
    images.mkdir(mode=0o700, parents=True)
    if descriptors_fifo:
        os.mkfifo(images / DESCRIPTORS, 0o600)
    else:
        (images / DESCRIPTORS).write_text(json.dumps(INIT_STDIO))


async def feed_descriptors(images: Path, reader: asyncio.subprocess.Process, complete: bool) -> None:
    """Lets the `runc restore` waiting on the images' FIFO go on: with the descriptors once the images are
    complete, else with nothing, on which it fails and cleans up after itself."""
    while True:
        try:
            fd = os.open(images / DESCRIPTORS, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as e:  # ENXIO: runc has not opened it yet
            if e.errno != errno.ENXIO or reader.returncode is not None:
                return  # runc already gave up; its exit status says why
            await asyncio.sleep(0.001)
    try:
        if complete:
            os.write(fd, json.dumps(INIT_STDIO).encode())
    finally:
        os.close(fd)


def release_orphaned_reader(fifo: Path) -> None:
    """EOF for a reader blocked on `fifo` whose writer is gone (a manager that died mid-fork)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader (ENXIO) or no FIFO: nothing is waiting


def link_images(source: Path, dest: Path) -> None:
    """Gives another restore the same images (hard links: same tmpfs, no copy), except its own FIFO."""
    for f in source.iterdir():
        if f.name != DESCRIPTORS:
            os.link(f, dest / f.name)


async def dump_leave_running(init_pid: int, bundle: Path, freezer: Path, images: Path, work: Path) -> None:
    """Dumps the container's whole process tree into `images` (made by make_images_dir); the container keeps
    running (or stays frozen if it was)."""
    config = json.loads((bundle / "config.json").read_text())
    work.mkdir(mode=0o700, parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        *dump_argv(init_pid, config, freezer, images, work), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await proc.communicate()
    except asyncio.CancelledError:
        await proc.wait()  # CRIU holds the tree seized: the caller may thaw it only once CRIU is done
        raise
    if proc.returncode != 0:
        raise BackendFailure(f"criu dump failed ({proc.returncode}): {err.decode(errors='replace').strip()} | "
                             f"criu: {log_errors(work / LOG)}")


def log_errors(path: Path, lines: int = 6) -> str:
    try:
        errors = [ln for ln in path.read_text(errors="replace").splitlines() if "Error" in ln]
    except FileNotFoundError:
        return "(no log)"
    return " / ".join(errors[-lines:])
