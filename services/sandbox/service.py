"""gRPC servicer of k3.v1.SandboxService: proto <-> manager translation, nothing else."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from k3.v1 import sandbox_pb2 as pb
from k3.v1 import sandbox_pb2_grpc
from services.sandbox.backends import registry
from services.sandbox.backends.base import SANDBOX_HOME, ExecSpec
from services.sandbox.limits import LimitRequest
from services.sandbox.manager import SandboxManager
from services.sandbox.record import Sandbox

_STATE = {True: pb.SANDBOX_STATE_PAUSED, False: pb.SANDBOX_STATE_RUNNING}


def sandbox_info(sb: Sandbox) -> pb.SandboxInfo:
    lim = sb.handle.limits
    return pb.SandboxInfo(
        sandbox_id=sb.sandbox_id, image=sb.handle.image.name, tenant=sb.tenant, state=_STATE[sb.paused],
        backend=sb.backend.name,
        limits=pb.ResourceLimits(memory_bytes=lim.memory_bytes, cpu_millis=lim.cpu_millis, pids=lim.pids,
                                 disk_bytes=lim.disk_bytes, wall_clock_s=lim.wall_clock_s, network=lim.network),
        memory_bytes=sb.backend.memory_bytes(sb.handle), snapshot_ids=list(sb.snapshots), created_unix=sb.created,
        idle_pause_s=int(sb.idle_pause_s), ttl_s=int(sb.ttl_s), snapshot_interval_s=int(sb.snapshot_interval_s),
        idle_s=time.monotonic() - sb.last_active, running_commands=sb.running_execs,
        memory_released=sb.handle.hibernated,
    )


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    def __init__(self, manager: SandboxManager) -> None:
        self.manager = manager

    async def CreateSandbox(self, request: pb.CreateSandboxRequest, context: grpc.aio.ServicerContext
                            ) -> pb.CreateSandboxResponse:
        lim = request.limits
        sb = await self.manager.create(
            image=request.image, tenant=request.tenant, backend=request.backend,
            limits=LimitRequest(lim.memory_bytes, lim.cpu_millis, lim.pids, lim.disk_bytes, lim.wall_clock_s,
                                lim.network),
            idle_pause_s=request.idle_pause_s, ttl_s=request.ttl_s,
            snapshot_interval_s=request.snapshot_interval_s, env=dict(request.env),
        )
        return pb.CreateSandboxResponse(sandbox=sandbox_info(sb))

    async def GetSandbox(self, request: pb.GetSandboxRequest, context: grpc.aio.ServicerContext
                         ) -> pb.GetSandboxResponse:
        return pb.GetSandboxResponse(sandbox=sandbox_info(self.manager.get(request.sandbox_id)))

    async def ListSandboxes(self, request: pb.ListSandboxesRequest, context: grpc.aio.ServicerContext
                            ) -> pb.ListSandboxesResponse:
        return pb.ListSandboxesResponse(sandboxes=[sandbox_info(s) for s in self.manager.list(request.tenant)])

    async def Exec(self, request: pb.ExecRequest, context: grpc.aio.ServicerContext
                   ) -> AsyncIterator[pb.ExecResponse]:
        spec = ExecSpec(argv=list(request.argv), stdin=request.stdin, timeout_s=float(request.timeout_s),
                        cwd=request.cwd or SANDBOX_HOME, env=dict(request.env), background=request.background)
        async for chunk in self.manager.exec(request.sandbox_id, spec):
            yield pb.ExecResponse(stdout=chunk.stdout, stderr=chunk.stderr, exited=chunk.exit_code is not None,
                                  exit_code=chunk.exit_code or 0)

    async def ReadFile(self, request: pb.ReadFileRequest, context: grpc.aio.ServicerContext
                       ) -> pb.ReadFileResponse:
        return pb.ReadFileResponse(data=await self.manager.read_file(request.sandbox_id, request.path))

    async def WriteFile(self, request: pb.WriteFileRequest, context: grpc.aio.ServicerContext
                        ) -> pb.WriteFileResponse:
        n = await self.manager.write_file(request.sandbox_id, request.path, request.data, request.mode)
        return pb.WriteFileResponse(bytes_written=n)

    async def PauseSandbox(self, request: pb.PauseSandboxRequest, context: grpc.aio.ServicerContext
                           ) -> pb.PauseSandboxResponse:
        return pb.PauseSandboxResponse(took_ms=await self.manager.pause(request.sandbox_id, request.release_memory))

    async def ResumeSandbox(self, request: pb.ResumeSandboxRequest, context: grpc.aio.ServicerContext
                            ) -> pb.ResumeSandboxResponse:
        return pb.ResumeSandboxResponse(took_ms=await self.manager.resume(request.sandbox_id))

    async def SnapshotSandbox(self, request: pb.SnapshotSandboxRequest, context: grpc.aio.ServicerContext
                              ) -> pb.SnapshotSandboxResponse:
        snap, ms = await self.manager.snapshot(request.sandbox_id)
        return pb.SnapshotSandboxResponse(snapshot_id=snap.ref.snapshot_id, memory=snap.ref.memory, took_ms=ms)

    async def RestoreSandbox(self, request: pb.RestoreSandboxRequest, context: grpc.aio.ServicerContext
                             ) -> pb.RestoreSandboxResponse:
        sb, ms = await self.manager.restore(request.snapshot_id)
        return pb.RestoreSandboxResponse(sandbox=sandbox_info(sb), took_ms=ms)

    async def ForkSandbox(self, request: pb.ForkSandboxRequest, context: grpc.aio.ServicerContext
                          ) -> pb.ForkSandboxResponse:
        children, ms = await self.manager.fork(request.sandbox_id, request.count or 1)
        return pb.ForkSandboxResponse(sandboxes=[sandbox_info(s) for s in children], took_ms=ms)

    async def DestroySandbox(self, request: pb.DestroySandboxRequest, context: grpc.aio.ServicerContext
                             ) -> pb.DestroySandboxResponse:
        await self.manager.destroy(request.sandbox_id)
        return pb.DestroySandboxResponse()

    async def DeleteSnapshot(self, request: pb.DeleteSnapshotRequest, context: grpc.aio.ServicerContext
                             ) -> pb.DeleteSnapshotResponse:
        self.manager.delete_snapshot(request.snapshot_id)
        return pb.DeleteSnapshotResponse()

    async def SetSandboxTimeout(self, request: pb.SetSandboxTimeoutRequest, context: grpc.aio.ServicerContext
                                ) -> pb.SetSandboxTimeoutResponse:
        self.manager.set_ttl(request.sandbox_id, request.ttl_s)
        return pb.SetSandboxTimeoutResponse()

    async def ListBackends(self, request: pb.ListBackendsRequest, context: grpc.aio.ServicerContext
                           ) -> pb.ListBackendsResponse:
        out = []
        for name, cls in registry.BACKENDS.items():
            reason = registry.unavailable_reason(name)
            caps = cls.capabilities
            out.append(pb.BackendInfo(name=name, available=name in self.manager.backends, reason=reason or "",
                                      memory_snapshot=caps.memory_snapshot, incremental=caps.incremental,
                                      live_fork=caps.live_fork, hibernate=caps.hibernate,
                                      is_default=name == self.manager.config.default_backend))
        return pb.ListBackendsResponse(backends=out)
