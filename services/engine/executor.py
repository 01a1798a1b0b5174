"""Runs a step on one TP rank: page copies, the forward (with the step's pulls in flight), imports,
exports, and the step commit."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from k3.v1 import common_pb2
from k3core.cache.manager import PrefixCacheManager
from services.engine import kv_pages
from services.engine.model_runner import ModelRunner
from services.engine.plan import ForwardItem, StepPlan
from services.kvtransfer.grpc_transport import GrpcTransport
from services.kvtransfer.relayout import rank_layout
from services.kvtransfer.transfer_thread import TransferThread
from services.kvtransfer.transport import Transport

log = logging.getLogger("k3.engine.executor")
T = TypeVar("T")


@dataclass
class StepResult:
    logits: torch.Tensor | None
    failed_imports: dict[str, str]  # rid -> why (on any rank)
    failed_exports: dict[str, str]


def _messages(failed: set[str], local: dict[str, str]) -> dict[str, str]:
    return {rid: local.get(rid, "a peer tensor-parallel rank failed this transfer") for rid in failed}


class Executor:
    def __init__(self, manager: PrefixCacheManager, runner: ModelRunner, *, rank: int, tp_size: int,
                 total_heads: int, instance: common_pb2.InstanceId, auth_token: str = "", speculative: bool = False):
        self.manager = manager
        self.runner = runner
        self.rank = rank
        self.tp_size = tp_size
        self.layout = rank_layout(total_heads, tp_size, rank)
        self.instance = instance
        self.auth_token = auth_token
        # Transfers run on their own thread, so a step's pulls progress while this thread computes.
        self._transfers = TransferThread()
        self._transports: dict[str, Transport] = {}  # only touched on the transfer thread
        self.fastpath = runner.decode_fastpath(manager, tp_size, speculative)

    def replay(self, plan: StepPlan) -> None:
        """Ranks > 0: apply rank 0's cache-manager calls of this step."""
        for name, args, kwargs in plan.manager_calls:
            getattr(self.manager, name)(*args, **kwargs)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run the step. Logits (identical on every rank) come back for the items that sample."""
        manager = self.manager
        manager.pre_forward()
        # The pulls start now and stream into host memory during the forward; only the copies into the pool
        # wait for them. A request takes no part in the forward of the step that imports it (the scheduler
        # admits it without tokens), so its pages are free to fill after the forward.
        pulls = {item.rid: self._transfers.submit(self._with_transport(
            item.transfer_address, lambda t, item=item: t.pull(item.handle_id, self.layout))) for item in plan.imports}
        logits = self._forward(plan.forward) if plan.forward else None
        for item in plan.forward:
            manager.forward_done(item.rid)
        import_errors: dict[str, str] = {}
        for item in plan.imports:
            try:
                pulled = pulls[item.rid].result()
                kv_pages.import_request(manager, item.rid, list(pulled.handle.pages), pulled.pages,
                                        item.shared_tokens)
            except Exception as exc:  # noqa: BLE001 - fails this request only, on every rank alike
                import_errors[item.rid] = f"{type(exc).__name__}: {exc}"
        failed_imports = self._agree([i.rid for i in plan.imports], import_errors)
        for item in plan.imports:
            if item.rid in failed_imports:
                manager.finish(item.rid, False)
            elif item.reserved:
                manager.forward_done(item.rid)
        export_errors: dict[str, str] = {}
        for item in plan.exports:
            try:
                self._export(item)
            except Exception as exc:  # noqa: BLE001 - reported to this request's caller
                export_errors[item.rid] = f"{type(exc).__name__}: {exc}"
        failed_exports = self._agree([e.rid for e in plan.exports], export_errors)
        manager.commit_step()
        return StepResult(logits, _messages(failed_imports, import_errors), _messages(failed_exports, export_errors))

    def _forward(self, items: list[ForwardItem]) -> torch.Tensor:
        """Decode steps and prefill chunks run as two forwards: a batch of single tokens takes the model's
        vectorised step path, which a single prefill chunk in the batch would switch off for everyone.
        Logits [sampling rows, V]: float32, or the fast path's own (model dtype; a view valid until its next
        replay) when it is the step's only forward."""
        groups = [[i for i, f in enumerate(items) if len(f.token_ids) == 1],
                  [i for i, f in enumerate(items) if len(f.token_ids) > 1]]
        outs: list[tuple[list[int], torch.Tensor]] = []
        for group in groups:
            if group:
                batch = [items[i] for i in group]
                cached = [self.manager.requests[f.rid] for f in batch]
                if group is groups[0] and self.fastpath is not None and self.fastpath.supports(cached):
                    out = self.fastpath.forward(cached, [f.token_ids[0] for f in batch])
                else:
                    out = self.runner.forward([f.token_ids for f in batch], self.manager.batch_view([f.rid for f in batch]))
                outs.append((group, out))
        if len(outs) == 1 and all(f.sample for f in items):
            return outs[0][1]  # one forward, every row samples: its logits as they are (no per-row split)
        rows: dict[int, torch.Tensor] = {}
        for group, out in outs:
            rows.update(zip(group, out.float(), strict=True))  # the fast path's logits are in the model dtype
        return torch.stack([rows[i] for i, f in enumerate(items) if f.sample]) if any(f.sample for f in items) \
            else torch.empty(0)

    def _agree(self, rids: list[str], local_errors: dict[str, str]) -> set[str]:
        """The items that failed on any rank (every rank must drop the same requests)."""
        if self.tp_size == 1 or not rids:
            return set(local_errors)
        flags = torch.tensor([int(r in local_errors) for r in rids], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return {r for r, flag in zip(rids, flags.tolist(), strict=True) if flag}

    def release_handles(self, plan: StepPlan) -> None:
        """Rank 0, after every rank imported: the staged pages are no longer needed."""
        for item in plan.imports:
            try:
                self._transfers.run(self._with_transport(item.transfer_address,
                                                         lambda t, item=item: t.release(item.handle_id)))
            except Exception as exc:  # noqa: BLE001 - the service's TTL frees it anyway
                log.warning("handle release failed", extra={"handle": item.handle_id, "error": str(exc)})

    def _export(self, item) -> None:
        # The replicated MLA pages travel once, from rank 0; the other ranks send their KDA heads only.
        refs, pages = kv_pages.export_request(self.manager, item.rid, replicated=self.rank == 0)
        req = self.manager.requests[item.rid]
        handle = common_pb2.KVHandle(handle_id=item.handle_id, request_id=item.rid, producer=self.instance,
                                     layout=self.layout, num_tokens=req.num_computed, pages=refs, model=item.model)
        self._transfers.run(self._with_transport(item.transfer_address, lambda t: t.push(handle, pages)))

    async def _with_transport(self, address: str, call: Callable[[Transport], Awaitable[T]]) -> T:
        """`call` on the transport to `address` (made on first use, on the transfer thread's loop)."""
        if address not in self._transports:
            self._transports[address] = GrpcTransport(address, self.auth_token)
        return await call(self._transports[address])

    def close(self) -> None:
        async def close_all() -> None:
            for transport in self._transports.values():
                await transport.close()
        self._transfers.run(close_all())
        self._transfers.close()
