"""Each fact lives once (issue 12): shared constants have one home, both kernel tables implement
the one Kernels contract, and tools reach tensors through public API (Tensor.offset, span)."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import lowgrad as lg
from lowgrad.buffers.tensor import span
from lowgrad.contracts.kernels import ELEMENTWISE, Elementwise, Kernels
from lowgrad.cuda.kernels import CudaKernels
from lowgrad.host.kernels import HostKernels

REPO = Path(__file__).resolve().parents[1]
# constant -> the one module that may assign it
HOMES = {"U32": "lowgrad/base/limits.py", "U64": "lowgrad/base/limits.py",
         "HOST_ALLOC_LIMIT": "lowgrad/base/limits.py", "SR_DTYPES": "lowgrad/sr/checks.py",
         "F32_MAX": "lowgrad/sr/checks.py", "OPS": "lowgrad/contracts/communicator.py",
         "SeedSource": "lowgrad/contracts/kernels.py"}
ALIASES = {"_U32": "U32", "_U64": "U64", "_HOST_LIMIT": "HOST_ALLOC_LIMIT", "_F32_MAX": "F32_MAX",
           "MULTI_MAX": "a kernel source", "MULTI_CHUNK": "a kernel source", "ELEMS_PER_THREAD": "a kernel source",
           "SUM": "OPS", "AVG": "OPS"}
VALUES = {"1 << 32": "U32", "1 << 64": "U64", "1 << 42": "HOST_ALLOC_LIMIT"}


def module_assignments() -> list[tuple[str, str, str]]:
    """(path, name, value source) of every module-level assignment in lowgrad/ and tools/."""
    out = []
    for path in sorted([*REPO.glob("lowgrad/**/*.py"), *REPO.glob("tools/*.py")]):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [e.id for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])
                         if isinstance(e, ast.Name)]
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                for i, name in enumerate(names):
                    v = values[i] if len(values) == len(names) else node.value
                    out.append((str(path.relative_to(REPO)), name, ast.unparse(v)))
    return out


def test_shared_constants_are_assigned_once() -> None:
    """_U64/_U32, _HOST_LIMIT, SR_DTYPES, the op codes and MULTI_MAX were each written in several
    modules; now one module assigns each, the others import it."""
    bad = []
    for path, name, value in module_assignments():
        if name in HOMES and HOMES[name] != path:
            bad.append(f"{path}: {name} belongs to {HOMES[name]}")
        if name in ALIASES:
            bad.append(f"{path}: {name} repeats {ALIASES[name]}")
        if value in VALUES and HOMES[VALUES[value]] != path:
            bad.append(f"{path}: {name} = {value} repeats {VALUES[value]}")
    assert not bad, "\n".join(bad)


#: the contract as the code states it: the methods each backend writes, and the elementwise
#: kernels each builds from their declaration
WRITTEN = Kernels.__abstractmethods__ - {"build"}
BUILT = {k.name for k in ELEMENTWISE}


def test_the_contract_is_read_from_the_code() -> None:
    assert BUILT == {name for name, v in vars(Kernels).items() if isinstance(v, Elementwise)}
    assert {"add_sr", "reduce_sr", "scale_sr"} <= BUILT and {"copy", "bind_reduce_sr"} <= WRITTEN
    assert not BUILT & WRITTEN and "build" in Kernels.__abstractmethods__


def built_tables() -> list[Kernels]:
    """A host table, and a CUDA one without a device (its elementwise kernels built as its
    constructor builds them; nothing is launched)."""
    cuda = object.__new__(CudaKernels)
    cuda.__dict__.update(_kernels={}, max_grid=1, group_elems=8)
    Kernels.__init__(cuda)
    return [lg.HostDevice().kernels, cuda]


def test_both_kernel_tables_implement_the_one_contract() -> None:
    for table in (CudaKernels, HostKernels):
        assert issubclass(table, Kernels) and not table.__abstractmethods__, table
        for name in WRITTEN:
            want = list(inspect.signature(getattr(Kernels, name)).parameters)
            got = list(inspect.signature(getattr(table, name)).parameters)
            assert got[:len(want)] == want, (table.__name__, name)
            assert all(inspect.signature(getattr(table, name)).parameters[p].default is not inspect.Parameter.empty
                       for p in got[len(want):]), (table.__name__, name)  # extras only as optional knobs
        assert not BUILT & set(vars(table)), table  # an elementwise kernel is built, never written per backend
    for kernels in built_tables():
        for decl in ELEMENTWISE:
            want = list(decl.signature.parameters)
            assert list(inspect.signature(getattr(kernels, decl.name)).parameters) == want, (kernels, decl.name)


def test_the_host_twin_has_no_launch_shape() -> None:
    for name in WRITTEN:
        assert "blocks" not in inspect.signature(getattr(HostKernels, name)).parameters, name


def test_tensor_offset_and_span() -> None:
    h = lg.HostDevice()
    lazy = h.lazy_allocator("host")
    ts = [lazy.alloc((n,), lg.bf16, f"t{n}") for n in (3, 100, 5)]
    lazy.commit()
    assert ts[0].offset == 0 and ts[1].offset > ts[0].offset + ts[0].nbytes - 1
    assert ts[1].view(10, 4).offset == ts[1].offset + 20
    s = span(ts, lg.byte)
    assert (s.allocation, s.offset, s.nbytes, s.name) == (ts[0].allocation, 0, ts[2].offset + ts[2].nbytes, "t3")
    assert s.ptr == ts[0].ptr
    b = span(ts[1:], lg.bf16, "pair")
    assert b.numel * 2 == ts[2].offset + ts[2].nbytes - ts[1].offset and b.name == "pair"
    with pytest.raises(ValueError, match="before"):
        span([ts[1], ts[0]], lg.byte)
    with pytest.raises(ValueError, match="allocation"):
        span([ts[0], h.alloc(4, lg.bf16, kind="host")], lg.byte)
    with pytest.raises(ValueError, match="whole"):
        span([ts[0]], lg.fp32)
    with pytest.raises(TypeError):
        span([], lg.byte)
    ts[0].close()
    assert ts[1].offset > 0  # known without the memory


def test_tools_and_tests_use_no_private_tensor_attributes() -> None:
    bad = []
    for path in sorted([*REPO.glob("tools/*.py"), *REPO.glob("tests/*.py")]):
        if path.name == Path(__file__).name:
            continue
        text = path.read_text()
        for attr in ("._alloc", "._offset", "._ptr"):
            if attr in text.replace(f"{attr}s", ""):
                bad.append(f"{path.name}: {attr}")
    assert not bad, bad
