"""The admission replicas that own cluster budgets: the live ones in etcd, with a mass loss damped.

When etcd stalls past the lease TTL and then expires every lease at once, the replica list would shrink for a
moment and budget ownership (rendezvous over the list, service.py) would move and move back: budgets counted
twice or dropped. The router's damping rule (services/router/damping.py) keeps the last-known records of
replicas lost in such a mass loss until they re-register or the grace ends; a single replica's loss moves
its clusters once it has lasted the settle time, as a real failure must.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from prometheus_client import Gauge

from services.router.damping import MassLossSettings
from services.runtime.registry import InstanceRecord

log = logging.getLogger("k3.admission")
MEMBERSHIP_DAMPED = Gauge("k3_admission_membership_damped",
                          "Admission replicas kept as budget owners on their last-known record during a damped "
                          "mass loss")
SERVICE = "admission"


class ReplicaView:
    def __init__(self, records: Callable[[], Iterable[InstanceRecord]], settings: MassLossSettings,
                 clock: Callable[[], float] = time.monotonic):
        self.records = records
        self.clock = clock
        self.damper = settings.damper("admission replicas", log)
        self._last_known: dict[str, InstanceRecord] = {}

    def __call__(self) -> list[InstanceRecord]:
        """The replicas to derive ownership from now (each call folds in the current etcd view)."""
        live = {r.instance: r for r in self.records() if r.service == SERVICE}
        kept = self.damper.observe(live, self.clock())
        self._last_known.update(live)
        self._last_known = {name: r for name, r in self._last_known.items() if name in live or name in kept}
        MEMBERSHIP_DAMPED.set(len(self.damper.damped))
        return [*live.values(), *(self._last_known[name] for name in sorted(kept - live.keys()))]
