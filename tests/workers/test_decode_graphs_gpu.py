"""`DecodeGraphs` on a GPU, both forms of the staging copy (K3_GRAPH_INPUT_COPY=0 / 1), with a stand-in
forward (twice the tokens, as float): a replay computes from the image it was launched with, and the
`copied` event means "this launch's copy has landed", not "some earlier copy" (with the copy inside the graph
it must be the graph's own event-record node): while a long kernel ahead of the launch holds the stream, the
event is still pending, so `staging` would wait instead of letting the host overwrite an image the device has
not read yet. The CPU stand-in of test_decode_overlap_staging.py cannot check this (it models the event)."""

from __future__ import annotations

import pytest
import torch

from k3core.cache.layout import plan_layout, shape_from_config
from k3core.presets import preset
from kernels import dispatch
from services.engine import cuda_graphs
from services.engine.cuda_graphs import DecodeGraphs
from services.engine.decode_inputs import DecodeInputBuilder, DecodeInputs

pytestmark = pytest.mark.gpu


def _doubled_tokens(inputs: DecodeInputs) -> torch.Tensor:
    return inputs.tokens.float()[:, None] * 2


@pytest.mark.parametrize("setting", ["0", "1"])
def test_a_launch_replays_its_image_and_its_copy_event_waits_for_it(setting, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv(cuda_graphs.COPY_ENV, setting)
    layout = plan_layout(shape_from_config(preset("nano"), "nano"))
    builder = DecodeInputBuilder(layout, max_pages=4, scratch_kda=0, scratch_mla=0)
    graphs = DecodeGraphs(_doubled_tokens, builder, torch.device("cuda"), max_batch=4)
    for step in range(3):
        image, size = graphs.staging(3)
        assert size == 4
        builder.token_slots(image, 3)[:] = [10 * step + 1, 10 * step + 2, 10 * step + 3]
        torch.cuda._sleep(200_000_000)  # ~0.1 s of one busy kernel ahead of the launch on the stream
        logits = graphs.launch(3)
        captured = graphs._graphs[4]
        assert captured.copy_in_graph == (setting == "1")
        assert not captured.copied.query()  # the copy waits behind the kernel: staging would block
        torch.cuda.synchronize()
        assert captured.copied.query()
        assert logits.cpu().flatten().tolist() == [2.0 * (10 * step + k) for k in (1, 2, 3)]


@pytest.mark.parametrize("form", ["torch", "triton"])
def test_a_look_ahead_replay_reads_the_draw_buffer_as_it_is_at_replay(form, monkeypatch):
    # The graph captures `resolve_on_device` (its Triton launch, or with the references forced its torch ops)
    # over a persistent draw buffer: each replay must read the buffer's
    # values when it runs (written by a copy queued before it), and park a row whose token is a stop id.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "1" if form == "torch" else "0")
    layout = plan_layout(shape_from_config(preset("nano"), "nano"))
    builder = DecodeInputBuilder(layout, max_pages=4, scratch_kda=0, scratch_mla=0, lookahead=True)
    drawn = torch.zeros(4, dtype=torch.int64, device="cuda")

    def resolved(inputs: DecodeInputs) -> torch.Tensor:
        got = inputs.resolve_on_device(drawn, 77, 88)
        return torch.stack([got.tokens, got.kda_slots[0], got.row_base[0]], 1).float()
    graphs = DecodeGraphs(resolved, builder, torch.device("cuda"), max_batch=4)
    for step in range(3):
        image, _ = graphs.staging(3)
        builder.prepare([], 4, out=image)
        source, stops = builder.ahead_parts(image, 4)
        source[:3] = [2, 1, 0]
        stops[0, :3] = 100 + step  # drawn row 1 below holds it: image row 1 stops
        torch.cuda._sleep(50_000_000)  # the draw's copy and the replay queue behind a busy kernel
        drawn.copy_(torch.tensor([10 * step, 100 + step, 10 * step + 2, 0]), non_blocking=True)
        out = graphs.launch(3).cpu().tolist()
        assert [row[0] for row in out] == [10 * step + 2, 100 + step, 10 * step]
        assert [row[1] for row in out] == [0, 77, 0]  # padding rows of prepare([]) sit on scratch_kda 0
        assert out[1][2] == 88
