"""Corrupt or mistyped cache bytes are caught, never served as state: a flipped bit in a CPU-tier or GPU
checkpoint is a counted miss, a transferred page's fingerprint is checked, and debug mode catches an MLA page
read as KDA state (which otherwise reads garbage)."""

from __future__ import annotations

import pytest
import torch
from cache_oracle import PrefixOracle
from cache_steps import LAYOUT, TOKENS, make, run

from k3core.cache.page_store import IntegrityError, PageKindError


def test_corrupt_cpu_checkpoint_is_a_counted_miss() -> None:
    manager, registry = make(cpu=64)
    run(manager, "a", TOKENS[:30])
    manager.evict_idle(manager.pool.num_pages)
    (host,) = manager.cpu.checkpoints()
    host.data[0][17] ^= 0x40  # one flipped bit in DRAM
    oracle = PrefixOracle(LAYOUT)
    tokens = TOKENS[:30] + [3] * 4
    oracle.learn(tokens)
    assert manager.add_request("b", tokens) == 0  # the only checkpoint is bad: a miss, not wrong state
    manager.pre_forward()
    oracle.check_private(manager, "b", tokens)
    assert registry.get_sample_value("k3_prefix_cache_integrity_errors_total", {"where": "prefetch"}) == 1
    assert manager.cpu.checkpoints() == []


def test_corrupt_gpu_checkpoint_is_caught_on_restore() -> None:
    manager, registry = make()
    run(manager, "a", TOKENS[:30])
    (checkpoint,) = manager.checkpoints.by_key.values()
    manager.store.data[checkpoint.pages[1], 5] ^= 1
    assert manager.add_request("b", TOKENS[:30] + [3]) == 0
    assert registry.get_sample_value("k3_prefix_cache_integrity_errors_total", {"where": "restore"}) == 1


def test_transfer_checks_fingerprints() -> None:
    manager, _ = make()
    run(manager, "a", TOKENS[:30])
    page = next(iter(manager.checkpoints.by_key.values())).pages[0]
    data, print_ = manager.store.export_page(page, LAYOUT.kda_page_used_bytes)
    data[3] ^= 8
    with pytest.raises(IntegrityError, match="fingerprint"):
        manager.store.import_page(page, data, print_)


def test_type_confusion_reads_garbage_and_debug_mode_catches_it() -> None:
    manager, _ = make()
    run(manager, "a", TOKENS[:30], finish=False)
    req = manager.requests["a"]
    mla_page, kda_page = req.blocks[0].pages[0], req.state_pages[0]
    conv, rec = manager.store.kda_views(kda_page, 0)
    manager.store.debug = False
    wrong_conv, wrong_rec = manager.store.kda_views(mla_page, 0)  # MLA latents read as KDA state
    # bf16 latents reinterpreted as float32 states: not within any tolerance of the real state, and
    # far outside the recurrence's integer range (or not finite)
    assert not torch.allclose(wrong_rec, rec, rtol=0.5) and not torch.equal(wrong_conv, conv)
    assert not bool(((wrong_rec == wrong_rec.round()) & (wrong_rec.abs() < 65521)).all())
    manager.store.debug = True
    with pytest.raises(PageKindError, match="holds MLA, accessed as KDA"):
        manager.store.kda_views(mla_page, 0)
    with pytest.raises(PageKindError, match="holds KDA, accessed as MLA"):
        manager.store.mla_rows(kda_page, 0)
