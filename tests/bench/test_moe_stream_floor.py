"""bench.moe_stream_floor's plumbing on CPU (no timing claims): its work items read every byte of the routed
experts exactly once and nothing else, at the real shapes and routings; its --cpu dry run folds the bytes
of tiny experts through every Triton form (interpreted) to the torch oracle's value."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import moe_stream_floor as floor
from kernels.moe.prepared_experts import PreparedExperts
from kernels.perf import moe_cases
from tests.kernels.conftest import interpreted  # noqa: F401 - the fixture

E_SMALL, L_SMALL, F_SMALL = 8, 256, 64


def _meta_experts(E: int, L: int, F: int) -> PreparedExperts:
    """Prepared experts' shapes without their bytes (work_items reads only shapes)."""
    def t(*shape, dtype):
        return torch.empty(*shape, dtype=dtype, device="meta")
    return PreparedExperts(t(E, 2 * F, L // 8, dtype=torch.int32), t(E, 2 * F, L // 32, dtype=torch.uint8),
                           t(E, L, F // 8, dtype=torch.int32), t(E, L, F // 32, dtype=torch.uint8))


def _coverage(items: torch.Tensor, experts: PreparedExperts, item: int) -> list[torch.Tensor]:
    """Per matrix, how often each word and each multiplier word [E, n] is read by `items`."""
    counts = []
    for kind, (words, mults) in enumerate(floor.matrices(experts)):
        for tensor, size in ((words, item), (mults, item // 16)):
            c = torch.zeros(tensor.numel(), dtype=torch.int32)
            for chunk in items[items[:, 0] == kind, 1].tolist():
                c[chunk * size:(chunk + 1) * size] += 1
            counts.append(c.reshape(tensor.shape))
    return counts


@settings(max_examples=25, deadline=None)
@given(ids=st.lists(st.integers(0, E_SMALL - 1), min_size=1, max_size=12),
       item=st.sampled_from([16, 64, 256, 1024]), kinds=st.sampled_from([(0,), (1,), (0, 1)]))
def test_items_read_each_byte_of_the_routed_experts_once(ids, item, kinds):
    experts = _meta_experts(E_SMALL, L_SMALL, F_SMALL)
    items = floor.work_items(torch.tensor([ids]), experts, item, kinds)
    routed = torch.zeros(E_SMALL, dtype=torch.bool)
    routed[ids] = True
    for i, counts in enumerate(_coverage(items, experts, item)):
        want = int(i // 2 in kinds)
        assert torch.equal(counts[routed], torch.full_like(counts[routed], want))
        assert not counts[~routed].any()


@pytest.mark.parametrize("T", [1, 4, 16])
def test_items_bytes_are_the_roofline_bytes_at_the_real_shape(T):
    """At E=256, l=2048, F=1024 every form's items read moe_cases.expert_bytes of each L2-fair set."""
    experts = _meta_experts(moe_cases.E, moe_cases.L, moe_cases.F)
    for ids in moe_cases.routings(T, torch.Generator().manual_seed(T))[:2]:
        for form in floor.FORMS:
            nbytes = sum(floor.item_bytes(floor.work_items(ids, experts, la.item, la.kinds), la.item)
                         for la in form.launches)
            assert nbytes == moe_cases.expert_bytes(ids), form.name


def test_t1_is_16_experts_of_53_5_megabytes():
    ids = moe_cases.routings(1, torch.Generator().manual_seed(0))[0]
    items = floor.work_items(ids, _meta_experts(moe_cases.E, moe_cases.L, moe_cases.F), 4096)
    assert items.shape[0] == 16 * (128 + 64)  # gate/up 2 MB + down 1 MB of words per expert, 16 KB items
    assert floor.item_bytes(items, 4096) == pytest.approx(53.5e6, rel=2e-3)


@pytest.mark.parametrize("n", [1, 63, 64, 1000])
def test_xor_all_is_the_xor_of_every_element(n):
    words = torch.randint(-2**31, 2**31 - 1, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int64)
    expected = 0
    for v in words.tolist():
        expected ^= v & 0xFFFFFFFF
    assert floor.xor_all(words.int()) == expected


def test_cpu_dry_run_folds_every_triton_form(interpreted, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setattr(sys, "argv", ["moe_stream_floor", "--cpu"])
    floor.main()
    out = capsys.readouterr().out
    triton_forms = [f for f in floor.FORMS if not all(la.tma for la in f.launches)]
    assert out.count("fold ok") == len(triton_forms) >= 8
