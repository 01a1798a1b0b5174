"""Membership damping: a mass loss of clusters is treated as a control-plane fault, not as dead clusters.

When etcd stalls (frozen process, disk stall, leader election) for longer than the lease TTL and returns,
it expires every lease at once and the router sees most or all clusters leave together although none died;
instances re-register within a second or two. Like the "full disruption" mode of Kubernetes' node lifecycle
controller, the router then keeps routing on the last-known healthy set for a grace period.

The rule: clusters that stopped being healthy within the last `window_s` and are still unhealthy are the
recent losses. When at least two of them are lost and they are more than `fraction` of the clusters that were
healthy before (or all of them), the loss is damped: those clusters stay routable until each returns or
`grace_s` after the damping began, whichever is first. A single-cluster loss is never damped (it is the
normal failover path); so a one-cluster fleet is never damped either.

Settling: etcd delivers a mass expiry as a cascade of deletes a few milliseconds apart, and an instance that
re-registered before its old lease was revoked shows as a delete and a put. So every loss takes effect only
once it has lasted `settle_s`: long enough to see the rest of a cascade, short against the lease TTL (a real
failure is acted on settle_s later than without damping).

The rule only sees names, so it damps any etcd-registered set: the admission controller uses it for its
replicas (budget ownership), with its own `subject` and logger.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

log = logging.getLogger("k3.router")


def is_mass_loss(lost: int, before: int, fraction: float) -> bool:
    """`lost` of the `before` clusters healthy before the window left: damp it?"""
    return lost >= 2 and (lost > fraction * before or lost == before)


@dataclasses.dataclass
class MassLossSettings:
    """The damping settings of a service config (router: clusters; admission: its replicas). When at least two
    members and more than `mass_loss_fraction` of the healthy ones (or all) leave within one lease TTL, it is
    taken for an etcd-side lease expiry and they stay on their last-known records for `mass_loss_grace_s`
    (default 2 x lease TTL) or until they re-register; 0 in either disables damping. Any loss takes effect
    once it has lasted `mass_loss_settle_s`. Mixed into a ServiceConfig (which supplies lease_ttl_s)."""

    mass_loss_fraction: float = 0.5
    mass_loss_grace_s: float | None = None
    mass_loss_settle_s: float = 0.1

    def mass_loss_grace(self) -> float:
        return 2 * self.lease_ttl_s if self.mass_loss_grace_s is None else self.mass_loss_grace_s

    def mass_loss_problems(self) -> list[str]:
        problems = []
        if not 0 <= self.mass_loss_fraction <= 1:
            problems.append(f"mass_loss_fraction: must be in [0, 1], got {self.mass_loss_fraction}")
        if not 0 <= self.mass_loss_settle_s <= self.lease_ttl_s:
            problems.append(f"mass_loss_settle_s: must be in [0, lease_ttl_s], got {self.mass_loss_settle_s}")
        if self.mass_loss_grace() < 0:
            problems.append(f"mass_loss_grace_s: must be >= 0, got {self.mass_loss_grace_s}")
        return problems

    def damper(self, subject: str = "clusters", logger: logging.Logger | None = None) -> MassLossDamper:
        return MassLossDamper(self.mass_loss_fraction, self.mass_loss_grace(), self.lease_ttl_s,
                              self.mass_loss_settle_s, subject, logger or log)


class MassLossDamper:
    def __init__(self, fraction: float, grace_s: float, window_s: float, settle_s: float,
                 subject: str = "clusters", logger: logging.Logger = log):
        # fraction or grace 0 disables damping (and settling with it: losses act at once, as without it).
        self.enabled = fraction > 0 and grace_s > 0
        self.fraction, self.grace_s, self.window_s = fraction, grace_s, window_s
        self.settle_s = settle_s if self.enabled else 0.0
        self._healthy: frozenset[str] = frozenset()
        self._lost_at: dict[str, float] = {}
        self._held: set[str] = set()
        self._held_until = float("-inf")
        # What the names are ("clusters", "admission replicas") in log lines, and where those go.
        self.subject, self.log = subject, logger

    @property
    def damped(self) -> frozenset[str]:
        """Clusters kept routable because they left in a mass loss."""
        return frozenset(self._held)

    def observe(self, healthy: Iterable[str], now: float) -> frozenset[str]:
        """Fold in the clusters healthy now; returns those to keep routing to although they are not
        (damped ones and losses still settling)."""
        healthy = frozenset(healthy)
        for name in self._healthy - healthy:
            self._lost_at[name] = now
        self._lost_at = {name: at for name, at in self._lost_at.items()
                         if name not in healthy and now - at <= max(self.window_s, self.settle_s)}
        if self._held and self._held <= healthy:
            self.log.info(f"membership damping ended: all held {self.subject} re-registered",
                          extra={"event": "membership_damping_ended", "not_returned": []})
        self._held -= healthy
        if self._held and now >= self._held_until:
            # Grace is over: what has not re-registered by now is lost for real (and must not re-trigger).
            self.log.warning("membership damping ended", extra={"event": "membership_damping_ended",
                                                                "not_returned": sorted(self._held)})
            for name in self._held:
                self._lost_at.pop(name, None)
            self._held = set()
        lost = {name for name, at in self._lost_at.items() if now - at <= self.window_s}
        if self.enabled and not lost <= self._held and is_mass_loss(len(lost), len(lost | healthy),
                                                                    self.fraction):
            if not self._held:
                self._held_until = now + self.grace_s
            self.log.warning(f"mass loss of {self.subject} damped (etcd-side expiry suspected); keeping the "
                             "last-known set", extra={"event": "membership_damped", "lost": sorted(lost),
                                                      "healthy": sorted(healthy), "grace_s": self.grace_s})
            self._held |= lost
        self._healthy = healthy
        return frozenset(self._held | self._settling(now))

    def _settling(self, now: float) -> set[str]:
        return {name for name, at in self._lost_at.items() if now - at < self.settle_s}

    def next_change(self, now: float) -> float | None:
        """When observe() would answer differently without a new snapshot (a settle or the grace ending)."""
        deadlines = [at + self.settle_s for name, at in self._lost_at.items() if now - at < self.settle_s]
        if self._held:
            deadlines.append(self._held_until)
        return min(deadlines, default=None)
