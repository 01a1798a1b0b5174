"""Compile Triton kernels for the H200 (sm_90) offline, as their launchers call them (CI has no GPU).

The interpreter (TRITON_INTERPRET=1) runs a kernel's Python without the compiler's checks (e.g. a
loop-carried variable that changes shape), so a kernel can pass every CPU test and still fail to build on
the device. Triton's CUDA backend and ptxas run without a GPU; this module drives them:

1. `record_launches()`: a context in which every `kernel[grid](...)` launch (interpreted or jitted) is
   recorded, not run, and turned into what Triton would compile on an sm_90 device: Triton's own binder
   (`create_function_from_signature` + `JITFunction._pack_args`, the code `JITFunction.run` calls) on the
   launch's real arguments gives the signature, the specialization (ints equal to 1 become constants,
   pointers and ints divisible by 16 get alignment attributes), the constexprs and the options
   (num_warps, num_stages, maxnreg). Launchers plan as for the device inside it (see its docstring).
2. `compile_specs()`: compiles each unique spec in worker processes without TRITON_INTERPRET. It cannot run
   in an interpreting process: there triton.language's own jitted helpers (tl.sigmoid, ...) are
   interpreter objects, which the code generator cannot call.

Which kernels exist to be covered is read from the source: kernels/launched_kernels.py.

Run by hand: record launches in a script, then `compile_specs(recorder.unique())`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kernels.launched_kernels import KERNELS_DIR, module_name

# A directory holding another Triton (e.g. the device's: `pip install --no-deps --target DIR triton==3.6.0`)
# for the compile workers to use instead of this environment's; its wheel ships ptxas as well.
TRITON_PATH_ENV = "K3_COMPILE_CHECK_TRITON_PATH"
H200_SMS = 132
H200_SHARED_BYTES = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin of the H200 (227 KiB)
# The device's default: Triton 3.9 warns when this is unset (its default flips in 3.10); 3.6 fuses.
FP_FUSION_ENV = {"TRITON_DEFAULT_FP_FUSION": "1"}


@dataclass
class CompileSpec:
    """One kernel specialization as JITFunction.run would compile it for sm_90."""

    kernel: str  # "module:function"
    signature: dict[str, str]
    constexprs: dict[tuple, Any]
    attrs: dict[tuple, Any]
    options: dict[str, Any]
    cases: list[str] = field(default_factory=list)

    def key(self) -> str:
        return repr((self.kernel, self.signature, sorted(self.constexprs.items()), sorted(self.attrs.items()),
                     sorted(self.options.items())))

    def describe(self) -> str:
        names = list(self.signature)
        consts = {names[path[0]]: v for path, v in self.constexprs.items()}
        runtime = {n: t for n, t in self.signature.items() if t != "constexpr"}
        opts = {k: self.options.get(k) for k in ("num_warps", "num_stages", "maxnreg")}
        return f"{self.kernel} {opts} constexprs={consts} signature={runtime}"


@dataclass
class CompileResult:
    ok: bool
    triton_version: str
    error: str = ""
    shared: int = 0  # bytes of shared memory the compiled kernel needs


# Triton is imported inside the functions: its first import fixes the interpreter mode for the process,
# which a test session sets before (tests/conftest.py).
def _target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


@functools.cache
def _jit_function(kernel: Any) -> Any:
    """The JITFunction of a launched kernel; under the interpreter one is built from the wrapped Python
    function with the decorator's own arguments (do_not_specialize, ...)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, **kernel.kwargs)


@functools.cache
def _binder(kernel: Any) -> tuple[Any, Any, Any]:
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    jit = _jit_function(kernel)
    backend = make_backend(_target())
    return jit, backend, create_function_from_signature(jit.signature, jit.params, backend)


def launch_spec(kernel: Any, args: tuple, kwargs: dict) -> CompileSpec:
    """What Triton specializes for one launch `kernel[grid](*args, **kwargs)` on an sm_90 device."""
    from triton import knobs

    jit, backend, binder = _binder(kernel)
    kwargs = {**kwargs, "debug": kwargs.get("debug", jit.debug) or knobs.runtime.debug}
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    return CompileSpec(f"{jit.fn.__module__}:{jit.fn.__name__}", signature, constexprs, attrs,
                       dict(options.__dict__))


class LaunchRecorder:
    """Collects the specs of recorded launches, per case label (see `record_launches`)."""

    def __init__(self, device_constexprs: dict[str, Any]) -> None:
        self.device_constexprs = device_constexprs
        self.specs: dict[str, CompileSpec] = {}
        self.label = ""

    @contextlib.contextmanager
    def case(self, label: str) -> Iterator[None]:
        self.label = label
        try:
            yield
        finally:
            self.label = ""

    def add(self, kernel: Any, args: tuple, kwargs: dict) -> None:
        names = list(_jit_function(kernel).arg_names)
        kwargs = {**kwargs, **{k: v for k, v in self.device_constexprs.items() if k in names}}
        spec = launch_spec(kernel, args, kwargs)
        spec = self.specs.setdefault(spec.key(), spec)
        if self.label and self.label not in spec.cases:
            spec.cases.append(self.label)

    def unique(self) -> list[CompileSpec]:
        return list(self.specs.values())

    def kernels(self) -> set[str]:
        return {s.kernel for s in self.specs.values()}


def import_kernel_modules() -> None:
    """Import every module under kernels/, and gluon (Triton's binder imports it on first use), so that none
    is first imported while recording (see below)."""
    importlib.import_module("triton.experimental.gluon")
    for path in sorted(KERNELS_DIR.rglob("*.py")):
        importlib.import_module(module_name(path))


@contextlib.contextmanager
def record_launches(device_constexprs: dict[str, Any] | None = None) -> Iterator[LaunchRecorder]:
    """Inside: Triton launches are recorded (specs for sm_90), not run, so launchers can be called at
    serving shapes on empty CPU tensors. Launchers plan as for the H200: `sm_count` answers 132 in every
    kernels module, TRITON_INTERPRET reads "0" (a launcher may pick a constexpr or a launch form by it), and
    `device_constexprs` replace constexprs a launcher derives from the tensors' device (e.g. USE_ASM). All
    kernel modules are imported first: a module decorated while TRITON_INTERPRET reads "0" would hold
    compiled-mode kernels for the rest of an interpreting process."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import_kernel_modules()
    recorder = LaunchRecorder(device_constexprs or {})

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        recorder.add(self, args, kwargs)

    from kernels import _triton

    patched = [(InterpretedFunction, "run", run), (JITFunction, "run", run)]
    patched += [(m, "sm_count", lambda device, cpu: H200_SMS) for m in list(sys.modules.values())
                if getattr(m, "__name__", "").startswith("kernels.") and getattr(m, "sm_count", None) is _triton.sm_count]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patched]
    env = {"TRITON_INTERPRET": "0", **FP_FUSION_ENV}
    saved_env = {k: os.environ.get(k) for k in env}
    try:
        for obj, name, value in patched:
            setattr(obj, name, value)
        os.environ.update(env)
        yield recorder
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def compile_specs(specs: list[CompileSpec], workers: int = 2, timeout: float = 600) -> list[CompileResult]:
    """Compile each spec for sm_90 in `workers` fresh processes (TRITON_INTERPRET unset); results in order.
    Triton's on-disk cache (TRITON_CACHE_DIR) makes repeated runs of unchanged kernels cheap; the workers
    use the Triton in $K3_COMPILE_CHECK_TRITON_PATH when set."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | FP_FUSION_ENV
    root = str(KERNELS_DIR.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get(TRITON_PATH_ENV), root, env.get("PYTHONPATH")) if p)
    shares = [list(range(i, len(specs), workers)) for i in range(min(workers, len(specs)))]
    procs = [subprocess.Popen([sys.executable, "-m", "kernels.compile_check"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=root) for _ in shares]

    def talk(share: list[int], proc: subprocess.Popen) -> tuple[bytes, bytes]:
        return proc.communicate(pickle.dumps([specs[i] for i in share]), timeout=timeout)

    results: list[CompileResult | None] = [None] * len(specs)
    # One thread per worker: a worker reads all its specs before it compiles, so feeding them one after the
    # other's results would compile one share at a time.
    try:
        with ThreadPoolExecutor(max(1, len(procs))) as pool:
            replies = list(pool.map(talk, shares, procs))
    finally:
        for proc in procs:  # a timeout or a failed sibling leaves no worker behind
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for share, proc, (out, err) in zip(shares, procs, replies, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"compile worker failed ({proc.returncode}): {err.decode()[-3000:]}")
        for i, result in zip(share, pickle.loads(out), strict=True):
            results[i] = result
    return results  # type: ignore[return-value]


def _compile_one(spec: CompileSpec) -> CompileResult:
    import triton
    from triton.compiler import ASTSource

    module, name = spec.kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    source = ASTSource
    if fn.is_gluon():  # a Gluon kernel is built from its own source class (explicit layouts, no ttir passes)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    try:
        compiled = triton.compile(source(fn, spec.signature, spec.constexprs, spec.attrs), target=_target(),
                                  options=spec.options)
    except Exception as e:  # noqa: BLE001 - the compiler's message is the result
        return CompileResult(False, triton.__version__, f"{type(e).__name__}: {e}")
    return CompileResult(True, triton.__version__, shared=int(compiled.metadata.shared))


def _worker() -> None:
    specs: list[CompileSpec] = pickle.loads(sys.stdin.buffer.read())
    results = [_compile_one(spec) for spec in specs]
    sys.stdout.buffer.write(pickle.dumps(results))


if __name__ == "__main__":
    # Through the module, not __main__: the results pickle as kernels.compile_check's classes.
    from kernels.compile_check import _worker as worker

    worker()
