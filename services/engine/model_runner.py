"""The model of one TP rank and its forward over a step's paged batch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from k3core.cache.interface import BatchCache
from k3core.cache.manager import PrefixCacheManager
from k3core.layers.moe import SparseMoE
from k3core.model import K3Model
from k3core.model.init import init_weights
from k3core.weights.checkpoint import load_checkpoint
from services.engine.decode_fastpath import DecodeFastPath, fastpath_wanted
from services.engine.fast_decoder import FastDecoder
from services.engine.fast_ffn import MoeDecode
from services.engine.fast_prefill import FastPrefill, prefill_fastpath_enabled
from services.engine.tensor_parallel import shard_model

if TYPE_CHECKING:  # not at run time: the config pulls in the service runtime (gRPC health, etcd), which
    # benchmarks on a bare accelerator image do without
    from services.engine.config import WorkerConfig


def build_model(config: WorkerConfig, rank: int, group: dist.ProcessGroup | None = None) -> K3Model:
    """The full model (checkpoint or seeded random weights), cut to this rank's shard."""
    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    model_config = config.model_config()
    model = K3Model(model_config)
    if config.checkpoint:
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        loaded = load_checkpoint(config.checkpoint, expected=expected, dtype=config.torch_dtype)
        model.load_state_dict(loaded.state_dict, strict=True)
    else:
        init_weights(model, seed=config.weights_seed)
    model = model.to(device=config.device, dtype=config.torch_dtype).eval()
    return shard_model(model, rank, config.tp_size, group)


def prefill_moe_forms(model: K3Model, decoder: FastDecoder) -> list[tuple[SparseMoE, MoeDecode]]:
    """(layer, fast form) of every MoE layer whose decode fast-path form also serves prefill chunks: the
    grouped one (sorted pairs and `torch._grouped_mm`, no host sync at any token count), on an unsharded
    rank (a TP rank's form all-reduces, which the reference TP forward already does around the layer)."""
    return [(layer.block_sparse_moe, op) for layer, op in zip(model.model.layers, decoder.ffn, strict=True)
            if layer.is_moe and isinstance(op, MoeDecode) and op.grouped and op.routed_wrapper is None]


@contextmanager
def installed(forms: list[tuple[SparseMoE, MoeDecode]]) -> Iterator[None]:
    """The MoE layers run their fast forms inside the block (`SparseMoE.fast_form`)."""
    for moe, op in forms:
        moe.fast_form = op
    try:
        yield
    finally:
        for moe, _ in forms:
            moe.fast_form = None


class ModelRunner:
    def __init__(self, model: K3Model, device: str, max_model_len: int = 32768, max_batch: int = 256):
        self.model = model
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.prefill_moe: list[tuple[SparseMoE, MoeDecode]] = []  # set with the decode fast path
        self.fast_prefill: FastPrefill | None = None  # likewise

    def decode_fastpath(self, manager: PrefixCacheManager, tp_size: int,
                        speculative: bool = False) -> DecodeFastPath | None:
        """The decode fast path over `manager`'s pool where it applies (CUDA, any TP; see fastpath_wanted;
        `speculative`: a draft model proposes, see DecodeFastPath).
        On an unsharded rank its forms then also run prefill forwards (`FastPrefill`, where every MoE form is
        grouped), or, with K3_PREFILL_FASTPATH=0, the MoE layers of the reference prefill (`prefill_moe_forms`)."""
        if not fastpath_wanted(self.device, tp_size) or manager.store is None:
            return None
        fast = DecodeFastPath(self.model, manager, max_model_len=self.max_model_len, max_batch=self.max_batch,
                              speculative=speculative)
        self.prefill_moe = prefill_moe_forms(self.model, fast.decoder) if tp_size == 1 else []
        applies = tp_size == 1 and FastPrefill.applies(fast.decoder)
        self.fast_prefill = FastPrefill(fast.decoder) if applies else None
        return fast

    @torch.no_grad()
    def forward(self, token_ids: Sequence[Sequence[int]], cache: BatchCache) -> torch.Tensor:
        """Logits [B, V] (float32) at the last new token of each sequence of the batch. A batch with a
        prefill chunk runs the MoE layers in their fast forms: the reference loops over experts with a
        device sync each (15 ms a layer on an H200 whatever the chunk size, 240 ms of a 512-token forward
        of mini); decode-only batches keep the reference layers, the fast path's oracle. With the fast path's
        `FastPrefill` (unsharded ranks) a prefill batch runs that instead: a fraction of the reference's kernel
        launches, which set the pace of a short chunk (services/engine/fast_prefill.py)."""
        flat = [t for tokens in token_ids for t in tokens]
        tokens = torch.tensor(flat, dtype=torch.long, device=self.device)
        prefill = len(flat) > len(token_ids)
        fast = self.prefill_fastpath() if prefill else None
        if fast is not None:
            return fast.forward(tokens, cache).float()
        with installed(self.prefill_moe if prefill else []):
            return self.model(tokens, cache, logits_for="last").float()

    def prefill_fastpath(self) -> FastPrefill | None:
        """The prefill fast path where it applies and K3_PREFILL_FASTPATH leaves it on (read per call:
        bench.serve_ttft switches it between forms in one process)."""
        return self.fast_prefill if prefill_fastpath_enabled() else None
