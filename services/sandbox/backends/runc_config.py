"""OCI runtime config for a CRIU-backed sandbox container.

A user namespace with an identity mapping is what makes checkpointing unprivileged tenants possible on hosts
where the manager lacks CAP_SYS_RESOURCE (containers, as here): CRIU must read every task's rlimits, which the
kernel allows only to a task holding CAP_SYS_RESOURCE in the *target's* user namespace, and root owns the
namespace runc creates.
"""

from __future__ import annotations

from pathlib import Path

from services.sandbox.backends.base import Limits
from services.sandbox.backends.cgroups import CFS_PERIOD_US, cfs_quota_us
from services.sandbox.backends.launch import BASE_ENV

# The init is one process that never wakes: `sleep` with SIGCHLD ignored, so the kernel reaps the orphans it
# adopts (re-parented background commands) at once. One task instead of a shell loop plus its `sleep` child
# is one task less for every dump and restore to seize, inject and rebuild.
INIT_ARGV = ["/usr/bin/env", "--ignore-signal=CHLD", "/usr/bin/sleep", "infinity"]
_ID_MAP = [{"containerID": 0, "hostID": 0, "size": 65536}]
# Only file masks (bind mounts of /dev/null): a directory mask is a tmpfs, and CRIU tars every tmpfs it dumps
# (~40 ms each on a loaded host). The tenant holds no capabilities, so those directories only leak host info.
_MASKED = ["/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
           "/proc/sched_debug"]
_READONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
# runc creates no device nodes under a bind-mounted /dev, so the usual ones are bound in from the host.
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_DEV_LINKS = {"ptmx": "pts/ptmx", "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
              "stderr": "/proc/self/fd/2"}


# runc has CRIU restore the network namespace empty (it never dumps network devices), so loopback comes back
# down. runc runs createRuntime hooks once CRIU has made the namespaces and before any task is restored (the
# state on stdin carries the new init's host pid): loopback is up before the tenant's code runs again. The
# tenant holds no CAP_NET_ADMIN, so "loopback up" is the whole state its network namespace can have.
_LOOPBACK_UP = r'read -r s; p=${s#*\"pid\":}; exec /usr/bin/nsenter -t "${p%%[!0-9]*}" -n /usr/sbin/ip link set lo up'
LOOPBACK_UP_HOOK = {"path": "/bin/sh", "args": ["sh", "-c", _LOOPBACK_UP], "timeout": 10}


def prepare_dev_dir(dev_dir: Path) -> None:
    dev_dir.mkdir(exist_ok=True)
    for name, target in _DEV_LINKS.items():
        if not (dev_dir / name).is_symlink():
            (dev_dir / name).symlink_to(target)
    for d in ("pts", "shm", "mqueue"):
        (dev_dir / d).mkdir(exist_ok=True)
    (dev_dir / "shm").chmod(0o1777)


def runc_config(rootfs: Path, dev_dir: Path, hostname: str, cgroups_path: str, limits: Limits,
                host_usr: bool, annotations: dict[str, str], restoring: bool = False) -> dict:
    """`dev_dir` is an empty host directory bind-mounted as /dev: a bind mount is external to CRIU, so it is
    neither archived on checkpoint nor rebuilt on restore (a tmpfs /dev would be, at tar speed).
    `restoring`: the bundle is for `runc restore`, which gets the loopback hook."""
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "bind", "source": str(dev_dir), "options": ["rbind", "nosuid"]},
        *({"destination": f"/dev/{d}", "type": "bind", "source": f"/dev/{d}", "options": ["bind", "nosuid"]}
          for d in DEVICES),
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
    ]
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount", "user")]
    if not limits.network:
        namespaces.append({"type": "network"})
        # sysfs may only be mounted by the owner of the network namespace, i.e. when it is our own.
        mounts.append({"destination": "/sys", "type": "sysfs", "source": "sysfs",
                       "options": ["nosuid", "noexec", "nodev", "ro"]})
    if host_usr:
        mounts.append({"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]})
    no_caps: list[str] = []
    hooks = {"createRuntime": [LOOPBACK_UP_HOOK]} if restoring and not limits.network else {}
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": INIT_ARGV,
            "env": [f"{k}={v}" for k, v in BASE_ENV.items()],
            "cwd": "/",
            "capabilities": {k: no_caps for k in ("bounding", "effective", "inheritable", "permitted", "ambient")},
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs), "readonly": False},
        "hostname": hostname,
        "annotations": annotations,
        "hooks": hooks,
        "mounts": mounts,
        "linux": {
            "uidMappings": _ID_MAP,
            "gidMappings": _ID_MAP,
            "namespaces": namespaces,
            "cgroupsPath": cgroups_path,
            "resources": {
                "memory": {"limit": limits.memory_bytes, "swap": limits.memory_bytes},
                "cpu": {"quota": cfs_quota_us(limits.cpu_millis), "period": CFS_PERIOD_US},
                "pids": {"limit": limits.pids},
            },
            "maskedPaths": _MASKED,
            "readonlyPaths": _READONLY,
        },
    }
