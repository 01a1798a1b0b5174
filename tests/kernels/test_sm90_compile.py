"""Every launched Triton kernel compiles for the H200 (sm_90) as its launcher calls it at serving shapes.

Why: the interpreter the other kernel tests run under does not type-check kernels the way the compiler
does (a loop-carried variable that changed shape passed every CPU test and failed to build on the H200).
How (kernels/compile_check.py): the launchers are called on empty CPU tensors at the `mini` preset's
shapes (bf16, served layouts: pool views, row-strided projection slices) with launches recorded instead
of run; Triton's own binder turns each launch into the signature, specialization, constexprs and options
JITFunction.run would compile for sm_90 on the device; every unique one is compiled (ptxas included) in
worker processes, and its shared memory held to the H200's 227 KiB. Launchers plan as on the H200 while
recording (132 SMs, TRITON_INTERPRET off, USE_ASM on).

Cases (sm90_launch_cases.py): the default configuration of each launcher at decode (batch 1 and 64) and
prefill; `-m slow` adds the tuning variants the benches time (kernels/perf/*_cases.py). A kernel that some
module under kernels/ launches but no case reaches fails `test_every_launched_kernel_is_covered`: add a case
for it there. The checker itself (error reporting, discovery, specialization) is tested in test_compile_check.py.

Triton versions: by default the workers compile with the CPU venv's Triton 3.9 while the device runs 3.6.
The front end checks (types, shapes, loop-carried values, constexpr use) agree, but a construct only one
version accepts, or a backend bug of one, is missed, and shared memory can differ (twice as much for one
KDA kernel under 3.6). Specs are always computed by 3.9's binder (the specialization rules are 3.6's).
For the device's own compiler: `pip install --no-deps --target DIR triton==3.6.0` (its wheel ships ptxas)
and set K3_COMPILE_CHECK_TRITON_PATH=DIR (CI does: .ci/setup installs it, .ci/test sets the variable).
"""

from __future__ import annotations

import os

import pytest

from kernels import compile_check
from kernels.launched_kernels import launched_kernels
from tests.kernels import sm90_launch_cases as launch_cases

DEVICE_CONSTEXPRS = {"USE_ASM": True}  # latent MoE: inline PTX on CUDA tensors
# "module:kernel" -> why, for a kernel known not to build that main must live with for a while (e.g.
# latent_moe_decode's _gate_up_kernel from 4820fdb to a013a8a); a listed kernel that builds fails the test.
KNOWN_FAILURES: dict[str, str] = {}


def _record(cases: dict) -> compile_check.LaunchRecorder:
    with compile_check.record_launches(DEVICE_CONSTEXPRS) as recorder:
        for label, case in cases.items():
            with recorder.case(label):
                case()
    return recorder


def _problem(result: compile_check.CompileResult) -> str | None:
    if not result.ok:
        return result.error[-2500:]
    if result.shared > compile_check.H200_SHARED_BYTES:
        return f"needs {result.shared} B of shared memory, the H200 has {compile_check.H200_SHARED_BYTES}"
    return None


def _check(specs: list[compile_check.CompileSpec]) -> None:
    """Compile every spec; fail naming each kernel that does not build (known failures aside, strictly)."""
    failures, failing, known_failing = [], set(), set()
    results = compile_check.compile_specs(specs)
    for spec, result in zip(specs, results, strict=True):
        problem = _problem(result)
        if problem and spec.kernel in KNOWN_FAILURES:
            known_failing.add(spec.kernel)
        elif problem:
            failing.add(spec.kernel)
            failures.append(f"{spec.describe()}\n  cases: {spec.cases}\n  {problem}")
    assert not failures, (f"{len(failures)} build(s) fail for sm_90 (Triton {results[0].triton_version}), "
                          f"of {sorted(failing)}:\n\n"
                          + "\n\n".join(failures))
    fixed = {k for k in KNOWN_FAILURES if any(s.kernel == k for s in specs)} - known_failing
    assert not fixed, f"these kernels build now: remove them from KNOWN_FAILURES: {sorted(fixed)}"


@pytest.fixture(scope="module")
def recorded() -> compile_check.LaunchRecorder:
    return _record(launch_cases.CASES)


@pytest.fixture(scope="module")
def recorded_gluon() -> compile_check.LaunchRecorder:
    """The Gluon kernels' launches (recorded by any Triton with Gluon; compiled only by the device's)."""
    return _record({f"latent moe gluon T={t}": lambda t=t: launch_cases.latent_moe_gluon(t) for t in (1, 16)})


def test_every_launched_kernel_is_covered(recorded, recorded_gluon):
    missing = launched_kernels() - recorded.kernels() - recorded_gluon.kernels()
    assert not missing, (f"launched Triton / Gluon kernels no case reaches (add one to {launch_cases.__file__}): "
                         f"{sorted(missing)}")


def test_every_kernel_compiles_for_sm90(recorded):
    _check(recorded.unique())


@pytest.mark.skipif(not os.environ.get(compile_check.TRITON_PATH_ENV),
                    reason="the Gluon kernels are written for the device's Triton 3.6 (set "
                    "K3_COMPILE_CHECK_TRITON_PATH); later releases renamed Gluon's cp.async and barrier calls")
def test_gluon_kernels_compile_for_sm90(recorded_gluon):
    _check(recorded_gluon.unique())


@pytest.mark.slow
def test_bench_variants_compile_for_sm90():
    _check(_record(launch_cases.bench_variants()).unique())
