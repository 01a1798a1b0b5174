"""k3.v1.AdmissionService over an AdmissionController, with one owner replica per cluster.

Each cluster's budgets are accounted on exactly one replica, chosen by rendezvous hashing of the cluster
name over the live admission replicas in etcd; any replica takes any call and forwards it to the owner
(once: a forwarded call is always served where it lands). Splitting a budget across replicas instead would
make a 1M-token request unadmittable as soon as its class budget per replica fell below its cost.
Tickets name the replica that issued them, so a release reaches the budget it came from.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from k3.v1 import admission_pb2, admission_pb2_grpc, common_pb2
from services.admission.classifier import RequestClassifier
from services.admission.controller import AdmissionController
from services.router.placement import rendezvous_rank
from services.runtime import errors
from services.runtime.registry import InstanceRecord

FORWARDED = "k3-admission-forwarded"
CLASS_PREFIX = "REQUEST_CLASS_"


def class_name(value: int) -> str | None:
    if value == 0:
        return None
    if value not in common_pb2.RequestClass.values():
        raise ValueError(f"request_class: unknown value {value}")
    return common_pb2.RequestClass.Name(value).removeprefix(CLASS_PREFIX)


def class_value(name: str) -> int:
    return common_pb2.RequestClass.Value(CLASS_PREFIX + name)


def owner_of(cluster: str, replicas: list[InstanceRecord]) -> InstanceRecord | None:
    ranked = rendezvous_rank(cluster, replicas)
    return ranked[0] if ranked else None


class AdmissionServicer(admission_pb2_grpc.AdmissionServiceServicer):
    def __init__(self, controller: AdmissionController, classifier: RequestClassifier, queue_timeout_ms: int,
                 replicas: Callable[[], list[InstanceRecord]], channel_for: Callable[[str], grpc.aio.Channel]):
        self.controller = controller
        self.classifier = classifier
        self.queue_timeout_ms = queue_timeout_ms
        self.replicas = replicas
        self.channel_for = channel_for

    async def Admit(self, request: admission_pb2.AdmitRequest, context) -> admission_pb2.AdmitResponse:
        if not request.cluster:
            raise errors.InvalidArgument("cluster", "must name the cluster the request targets")
        try:
            classified = self.classifier.classify(request.prompt_tokens, request.cached_tokens,
                                                  request.max_output_tokens, request.failover,
                                                  class_name(request.request_class))
        except ValueError as exc:
            field, _, message = str(exc).partition(": ")
            raise errors.InvalidArgument(field, message) from None
        owner = self._remote_owner(request.cluster, context)
        if owner is not None:
            return await self._forward(owner, "Admit", request, context)
        started = time.monotonic()
        ticket = await self.controller.admit(request.cluster, classified,
                                             (request.queue_timeout_ms or self.queue_timeout_ms) / 1e3)
        return admission_pb2.AdmitResponse(
            ticket=self.controller.ticket_id(request.cluster, ticket),
            request_class=class_value(ticket.request_class), cost=ticket.cost,
            queued_ms=1e3 * (time.monotonic() - started))

    async def ReleaseTicket(self, request: admission_pb2.ReleaseTicketRequest,
                            context) -> admission_pb2.ReleaseTicketResponse:
        parts = request.ticket.rsplit("/", 2)
        if len(parts) != 3 or not all(parts):
            raise errors.InvalidArgument("ticket", f"{request.ticket!r} is not a ticket from Admit")
        issuer = parts[0]
        if issuer == self.controller.instance:
            released = self.controller.release(request.ticket, request.prefill_done)
            return admission_pb2.ReleaseTicketResponse(found=released.found, returned_cost=released.returned)
        record = next((r for r in self.replicas() if r.instance == issuer), None)
        if record is None or self._forwarded(context):
            # The issuing replica is gone, and its budgets with it.
            return admission_pb2.ReleaseTicketResponse(found=False)
        return await self._forward(record, "ReleaseTicket", request, context)

    async def GetBudgets(self, request: admission_pb2.GetBudgetsRequest, context) -> admission_pb2.GetBudgetsResponse:
        if not request.cluster:
            raise errors.InvalidArgument("cluster", "must name a cluster")
        owner = self._remote_owner(request.cluster, context)
        if owner is not None:
            return await self._forward(owner, "GetBudgets", request, context)
        sched = self.controller.scheduler(request.cluster)
        return admission_pb2.GetBudgetsResponse(owner=self.controller.instance, budgets=[
            admission_pb2.ClassBudget(request_class=class_value(cls), budget=account.budget,
                                      in_use=account.in_use, queued=len(sched.queues[cls]),
                                      admitted=sched.stats[cls].admitted, rejected=sched.stats[cls].rejected)
            for cls, account in sched.ledger.accounts.items()])

    def _remote_owner(self, cluster: str, context) -> InstanceRecord | None:
        if self._forwarded(context):
            return None
        owner = owner_of(cluster, self.replicas())
        return None if owner is None or owner.instance == self.controller.instance else owner

    @staticmethod
    def _forwarded(context) -> bool:
        return any(key == FORWARDED for key, _ in context.invocation_metadata() or ())

    async def _forward(self, owner: InstanceRecord, method: str, request, context):
        stub = admission_pb2_grpc.AdmissionServiceStub(self.channel_for(owner.address))
        try:
            return await getattr(stub, method)(request, timeout=context.time_remaining(),
                                               metadata=((FORWARDED, "1"),))
        except grpc.aio.AioRpcError as exc:
            # Pass the owner's answer through unchanged, trailers (error detail, retry hint) included.
            context.set_trailing_metadata(tuple(exc.trailing_metadata() or ()))
            await context.abort(exc.code(), exc.details())
