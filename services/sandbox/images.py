"""Image store: root filesystems prepared once and shared read-only as the lower layer of every sandbox.

The built-in `base` image is a small skeleton (/etc, /home/user, /tmp, the merged-/usr symlinks) whose /usr
is the host's /usr bind-mounted read-only at start. That gives every sandbox a full Debian userland (python3,
coreutils) for zero bytes of image data and one shared page cache, which is what density needs here. Other
images are directory trees imported into the store (a production deployment would pull OverlayBD layers;
see docs/sandbox.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from services.sandbox.errors import InvalidRequest, NotFound

BASE_IMAGE = "base"
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_SKELETON_DIRS = ("usr", "etc", "tmp", "var/tmp", "run", "proc", "dev", "sys", "root", "home/user", "opt")
_USR_LINKS = {"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "usr/lib64"}
_ETC_FILES = {
    "passwd": "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:sandbox user:/home/user:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost\n::1 localhost\n",
    "hostname": "sandbox\n",
    "resolv.conf": "",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
}


@dataclass(frozen=True)
class Image:
    name: str
    rootfs: Path
    host_usr: bool  # bind the host's /usr read-only over the image's empty /usr


class ImageStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def get(self, name: str) -> Image:
        if not _NAME.match(name):
            raise InvalidRequest("image", f"invalid image name {name!r}")
        if name == BASE_IMAGE:
            return self.ensure_base()
        meta = self.root / name / "image.json"
        if not meta.exists():
            raise NotFound(f"image {name!r} not found")
        return Image(name, self.root / name / "rootfs", bool(json.loads(meta.read_text())["host_usr"]))

    def names(self) -> list[str]:
        return sorted(p.parent.name for p in self.root.glob("*/image.json"))

    def ensure_base(self) -> Image:
        """Builds the skeleton once; later calls find it ready."""
        if not (self.root / BASE_IMAGE / "image.json").exists():
            self._install(BASE_IMAGE, _write_skeleton, host_usr=True)
        return Image(BASE_IMAGE, self.root / BASE_IMAGE / "rootfs", True)

    def import_tree(self, name: str, source: Path, host_usr: bool = True) -> Image:
        """Copies a directory tree in as an image, over the base skeleton (so /etc/passwd etc. exist)."""
        if not _NAME.match(name) or name == BASE_IMAGE:
            raise InvalidRequest("image", f"invalid image name {name!r}")

        def build(rootfs: Path) -> None:
            _write_skeleton(rootfs)
            shutil.copytree(source, rootfs, symlinks=True, dirs_exist_ok=True)

        self._install(name, build, host_usr)
        return self.get(name)

    def _install(self, name: str, build, host_usr: bool) -> None:
        # Built beside the final place and renamed in, so a crash never leaves a half image in use.
        final = self.root / name
        staging = self.root / f".{name}.staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "rootfs").mkdir(parents=True)
        build(staging / "rootfs")
        (staging / "image.json").write_text(json.dumps({"name": name, "host_usr": host_usr}))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(staging, final)


def _write_skeleton(rootfs: Path) -> None:
    for d in _SKELETON_DIRS:
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    for link, target in _USR_LINKS.items():
        (rootfs / link).symlink_to(target)
    for fname, text in _ETC_FILES.items():
        (rootfs / "etc" / fname).write_text(text)
    # Debian reaches many /usr commands (awk, editor, ...) through /etc/alternatives symlinks.
    if Path("/etc/alternatives").is_dir():
        shutil.copytree("/etc/alternatives", rootfs / "etc/alternatives", symlinks=True)
    os.chmod(rootfs / "tmp", 0o1777)
    os.chmod(rootfs / "var/tmp", 0o1777)
    os.chown(rootfs / "home/user", 1000, 1000)
