"""Snapshot registry: which snapshots exist, who owns them, persisted beside their data.

Each snapshot directory carries a `snapshot.json` record, so a restarted manager finds every snapshot it had
and can still restore it; deleting a snapshot removes its directory.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.sandbox.backends.base import Limits, SnapshotRef
from services.sandbox.errors import InvalidRequest, NotFound

RECORD = "snapshot.json"


@dataclass
class Snapshot:
    ref: SnapshotRef
    tenant: str
    source: str  # the sandbox it was taken from (which may be gone by now)
    created: float = field(default_factory=time.time)


class SnapshotStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.snapshots: dict[str, Snapshot] = {}
        for meta in self.root.glob(f"*/{RECORD}"):
            rec = json.loads(meta.read_text())
            ref = SnapshotRef(rec["snapshot_id"], rec["backend"], meta.parent, rec["image"],
                              Limits(**rec["limits"]), rec["env"], rec["memory"])
            self.snapshots[ref.snapshot_id] = Snapshot(ref, rec["tenant"], rec["source"], rec["created"])

    def path_for(self, snapshot_id: str) -> Path:
        return self.root / snapshot_id

    def add(self, snap: Snapshot) -> None:
        ref = snap.ref
        record = {"snapshot_id": ref.snapshot_id, "backend": ref.backend, "image": ref.image,
                  "limits": asdict(ref.limits), "env": ref.env, "memory": ref.memory, "tenant": snap.tenant,
                  "source": snap.source, "created": snap.created}
        (ref.dir / RECORD).write_text(json.dumps(record))
        self.snapshots[ref.snapshot_id] = snap

    def get(self, snapshot_id: str) -> Snapshot:
        if not snapshot_id:
            raise InvalidRequest("snapshot_id", "must not be empty")
        snap = self.snapshots.get(snapshot_id)
        if snap is None:
            raise NotFound(f"snapshot {snapshot_id} not found (deleted or never taken)")
        return snap

    def delete(self, snapshot_id: str) -> Snapshot:
        snap = self.get(snapshot_id)
        del self.snapshots[snapshot_id]
        shutil.rmtree(snap.ref.dir, ignore_errors=True)
        return snap

    def discard(self, snapshot_id: str) -> None:
        """Removes the data of a snapshot that failed half way (it was never added)."""
        shutil.rmtree(self.path_for(snapshot_id), ignore_errors=True)
