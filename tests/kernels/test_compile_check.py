"""kernels/compile_check itself, on small kernels: a build failure the interpreter misses is reported with
the kernel's name, launched kernels are found in the source (kernels/launched_kernels.py), and launches
specialize as Triton's rules say (test_sm90_compile.py applies it to every kernel of the product)."""

from __future__ import annotations

import torch

from kernels import compile_check
from kernels._triton import tl, triton
from kernels.fused import moe_combine_triton
from kernels.launched_kernels import launched_kernels

F32, I64 = torch.float32, torch.int64
LATENT, TOP_K = 1024, 4  # mini's latent width and top-k


def empty(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


if triton is not None:

    @triton.jit
    def _reshaped_mask_kernel(x, N, BLOCK: tl.constexpr):
        """fb4b276's bug: `ok` is loop-carried, [BLOCK] before the loop and [1, BLOCK] in it (the interpreter
        runs it; the compiler refuses it)."""
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        for i in range(N):
            ok = (cols < N - i)[None, :]
        tl.store(x + cols[None, :], 0.0, mask=ok)

    @triton.jit
    def _kept_mask_kernel(x, N, BLOCK: tl.constexpr):
        """The fixed form: a distinct name for the second shape."""
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        for i in range(N):
            row_ok = (cols < N - i)[None, :]
            tl.store(x + cols[None, :], 0.0, mask=row_ok & ok[None, :])


def test_a_loop_carried_shape_change_is_reported_with_the_kernel_name(interpreted):
    """The check itself: the incident's bug runs interpreted but fails to build, named; its fixed form builds."""
    _reshaped_mask_kernel[(1,)](torch.ones(64), 64, BLOCK=64)  # the interpreter takes it
    with compile_check.record_launches() as recorder:
        for kernel in (_reshaped_mask_kernel, _kept_mask_kernel):
            kernel[(1,)](empty(64, dtype=F32), 64, BLOCK=64)
    bad, good = compile_check.compile_specs(recorder.unique())
    assert not bad.ok and "Loop-carried variable ok" in bad.error, bad.error
    assert "_reshaped_mask_kernel" in recorder.unique()[0].describe()
    assert good.ok, good.error


def test_discovery_lists_launched_kernels_not_device_functions(tmp_path):
    """Kernels (Triton or Gluon) launched by name, through an imported name or a module attribute count; jit
    functions never launched with a grid (device helpers) do not."""
    package = tmp_path / "kernels"
    (package / "sub").mkdir(parents=True)
    jit = "@triton.jit\ndef {}(x):\n    pass\n\n\n"
    (package / "sub" / "a.py").write_text(
        "import triton\n\n" + "".join(jit.format(n) for n in ("_helper", "_own", "_imported", "_via_module", "_idle"))
        + "def launch(x):\n    _own[(1,)](x)\n")
    (package / "b.py").write_text("from kernels.sub import a\nfrom kernels.sub.a import _imported\n\n"
                                  "def launch(x):\n    _imported[(1,)](x)\n    a._via_module[(2,)](x)\n")
    (package / "c.py").write_text("if gluon is not None:\n    @gluon.jit(do_not_specialize=['x'])\n    def _gluon(x):\n"
                                  "        pass\n\n    @gluon.jit\n    def _gluon_helper(x):\n        pass\n\n"
                                  "def launch(x):\n    _gluon[(1,)](x)\n")
    found = launched_kernels(package)
    assert found == {"kernels.sub.a:_own", "kernels.sub.a:_imported", "kernels.sub.a:_via_module", "kernels.c:_gluon"}
    real = launched_kernels()
    assert "kernels.kda.prefill_chunk_triton:_kda_chunk_ut_kernel" in real  # launched from prefill_triton
    assert "kernels.moe.decode_wgmma_gluon:down_kernel" in real  # a Gluon kernel, launched in its own module
    assert not {k for k in real if k.endswith((":mxfp4_tile", ":unshift", ":situ_glu_values", ":situ_glu"))}


def test_specialization_follows_triton():
    """Triton's rules, by hand: an int equal to 1 becomes a constant, ints and pointers divisible by 16 get
    tt.divisibility 16, other ints none; floats are fp32; launch options come through."""
    with compile_check.record_launches() as recorder:
        moe_combine_triton.moe_combine(empty(64, LATENT), torch.zeros(1, TOP_K, dtype=I64),
                                       empty(1, TOP_K, dtype=F32), 1, 0, num_warps=8)
    (spec,) = recorder.unique()
    names = list(spec.signature)
    consts = {names[p[0]]: v for p, v in spec.constexprs.items()}
    hinted = {names[p[0]] for p, a in spec.attrs.items() if ["tt.divisibility", 16] in a}
    assert spec.signature["rows"] == "*bf16" and spec.signature["weight"] == "*fp32"
    assert spec.signature["eps"] == "fp32" and spec.signature["K"] == "i32"
    assert consts["index_stride"] == 1 and consts["HAS_NORM"] is False and consts["BLOCK_L"] == LATENT
    assert {"rows", "index", "weight", "L", "stride_rows", "token_stride"} <= hinted  # 1024, 1024, 0
    assert "K" not in hinted  # 4
    assert spec.options["num_warps"] == 8
