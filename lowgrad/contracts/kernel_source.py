"""The kernels' sources read as data, without a GPU: where they are (:func:`kernel_dir`, in a wheel
or a checkout), each ``extern "C" __global__`` entry point of ``kernels/*.cu`` (written out, or
instantiated from a ``#define`` macro) as a :class:`KernelSpec` (module, symbol, parameters, block
size), the integer ``enum`` constants of a source and its headers (:func:`constants`), and the
fields of a ``struct`` (:func:`struct_fields`). A kernel's signature, and every constant that
Python and CUDA share, is therefore written once, in CUDA; any layer reads it here.

The reader understands the subset of C the sources use: scalar parameters (``float``,
``double``, ``int``, ``u32``, ``u64``), pointers (passed as 64-bit addresses), one struct passed
by value whose fields are such scalars or fixed arrays of them, ``__launch_bounds__(block, ...)``
and enum constants whose values are integer expressions of earlier constants. Anything else is a
ValueError naming the kernel, so a new construct cannot be packed wrongly in silence.
"""
from __future__ import annotations

import ast
import ctypes
import functools
import operator
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowgrad.base.dtypes import as_dtype

#: C scalar types of kernel parameters -> ctypes (every pointer is a c_uint64 device address)
SCALARS: dict[str, Any] = {"float": ctypes.c_float, "double": ctypes.c_double, "int": ctypes.c_int32,
                           "u32": ctypes.c_uint32, "unsigned": ctypes.c_uint32, "u64": ctypes.c_uint64}
_QUALIFIERS = re.compile(r"\b(const|__restrict__|__grid_constant__|volatile)\b")
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\(([^()]*)\)\s*)?'
                    r"([\w#\s]+?)\s*\(([^()]*)\)")
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)\(([^()]*)\)(.*)$", re.M)
_ENUM = re.compile(r"\benum\b[^{;]*\{([^{}]*)\}")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
_LITERAL = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]*\b")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_}
DEFAULT_BLOCK = 256  # threads per block of a kernel without __launch_bounds__
_TAG = {"fp32": "f32", "bf16": "bf16", "fp64": "f64"}  # dtype -> its suffix in kernel symbols


@dataclass(frozen=True)
class Param:
    """One scalar parameter, or one field of a by-value struct: ``count`` consecutive values of
    ``ctype`` (1 for a scalar, the length for an array field)."""

    name: str
    ctype: Any
    count: int = 1


@dataclass(frozen=True)
class KernelSpec:
    """One ``extern "C"`` kernel: the module (``kernels/<module>.cu``) holding ``symbol``, its
    parameters in order, and the block size it is built for (``__launch_bounds__``; norm
    kernels need a power of two up to it). ``struct``: the kernel takes one struct by value
    whose fields are ``params`` (C layout)."""

    module: str
    symbol: str
    params: tuple[Param, ...]
    block: int = DEFAULT_BLOCK
    struct: bool = False

    @property
    def args(self) -> tuple[Any, ...]:
        """The ctypes type of every value packed, arrays flattened (pointers are c_uint64)."""
        return tuple(t for p in self.params for t in (p.ctype,) * p.count)

    def flatten(self, values: Mapping[str, Any]) -> list[Any]:
        """``values`` by parameter name as the flat argument list of :attr:`args`; an array
        field takes a sequence of up to ``count`` values, padded with zeros."""
        if set(values) != {p.name for p in self.params}:
            raise ValueError(f"{self.symbol} takes {[p.name for p in self.params]}, got {sorted(values)}")
        out: list[Any] = []
        for p in self.params:
            v = values[p.name]
            if p.count == 1 and not isinstance(v, (list, tuple)):
                out.append(v)
            elif len(v) > p.count:
                raise ValueError(f"{self.symbol}.{p.name} holds {p.count} values, got {len(v)}")
            else:
                out += [*v, *[0] * (p.count - len(v))]
        return out


def _strip(text: str) -> str:
    """``text`` without comments and with backslash-continued lines joined."""
    return _COMMENTS.sub(" ", text).replace("\\\n", " ")


def _eval(expr: str, consts: Mapping[str, int]) -> int:
    """An integer C expression of literals and ``consts`` (+ - * / << >> | and parentheses)."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name) and node.id in consts:
            return consts[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return int(_OPS[type(node.op)](ev(node.left), ev(node.right)))
        raise ValueError(f"not an integer constant expression: {expr!r}")
    c = _LITERAL.sub(lambda m: str(int(m.group(1), 0)), expr).replace("/", "//")
    try:
        return ev(ast.parse(c.strip(), mode="eval").body)
    except SyntaxError as e:
        raise ValueError(f"not an integer constant expression: {expr!r}") from e


def _enum_constants(text: str, consts: dict[str, int]) -> None:
    """Add every ``NAME = value`` of the enums in ``text`` whose value is a constant expression
    (enums inside templates, e.g. of ``sizeof(T)``, are not constants of the source)."""
    for body in _ENUM.findall(text):
        for item in body.split(","):
            name, eq, value = item.partition("=")
            if eq and re.fullmatch(r"\s*\w+\s*", name):
                try:
                    consts[name.strip()] = _eval(value, consts)
                except ValueError:
                    pass


def _includes(text: str, directory: Path, seen: dict[str, str], open_: frozenset[str] = frozenset()) -> None:
    """Add every header ``text`` includes to ``seen``, each after the headers it includes itself
    (the order a compiler reads them in, so an enum may use a constant of an earlier header)."""
    for h in _INCLUDE.findall(text):
        if h not in seen and h not in open_:
            body = _strip((directory / h).read_text())
            _includes(body, directory, seen, open_ | {h})
            seen[h] = body


def _substitute(body: str, args: Mapping[str, str]) -> str:
    """``body`` with every whole word that names a macro parameter replaced by its argument."""
    return re.sub(r"\b\w+\b", lambda t: args.get(t.group(0), t.group(0)), body)


def _expansions(text: str) -> Iterator[tuple[str, str, str]]:
    """(launch bounds, symbol, parameter list) of every entry point: written out, or in the body
    of a macro (one or more) and then once per use of the macro with its arguments substituted."""
    macros = {}
    for name, formals, body in _DEFINE.findall(text):
        if _ENTRY.search(body):
            macros[name] = ([f.strip() for f in formals.split(",")], body)
    plain = _DEFINE.sub(" ", text)
    for m in _ENTRY.finditer(plain):
        yield m.group(1) or "", m.group(2), m.group(3)
    for name, (formals, body) in macros.items():
        for use in re.finditer(rf"\b{name}\s*\(([^()]*)\)", plain):
            actual = [a.strip() for a in use.group(1).split(",")]
            if len(actual) != len(formals):
                raise ValueError(f"{name}({use.group(1)}): {len(actual)} arguments for {len(formals)} parameters")
            expanded = re.sub(r"\s*##\s*", "", _substitute(body, dict(zip(formals, actual))))
            found = list(_ENTRY.finditer(expanded))  # a macro may declare several entry points
            if not found:
                raise ValueError(f"{name}({use.group(1)}): the expansion declares no kernel")
            for f in found:
                yield f.group(1) or "", f.group(2), f.group(3)


def _declarator(decl: str, symbol: str) -> tuple[str, Any]:
    """(name, ctypes type) of one ``type name`` declaration with its qualifiers removed."""
    words = _QUALIFIERS.sub(" ", decl).replace("*", " * ").split()
    if len(words) < 2:
        raise ValueError(f"{symbol}: cannot read the declaration {decl.strip()!r}")
    if "*" in words:
        return words[-1], ctypes.c_uint64
    ctype = SCALARS.get(" ".join(words[:-1]))
    if ctype is None:
        raise ValueError(f"{symbol}: unsupported parameter type in {decl.strip()!r}")
    return words[-1], ctype


def _struct_fields(text: str, name: str, consts: Mapping[str, int], symbol: str) -> tuple[Param, ...]:
    m = re.search(rf"\bstruct\s+{name}\s*\{{([^{{}}]*)\}}", text)
    if m is None:
        raise ValueError(f"{symbol}: parameter type {name!r} is neither a scalar nor a struct of the source")
    fields: list[Param] = []
    for decl in filter(str.strip, m.group(1).split(";")):
        base, *more = decl.split(",")
        type_words = re.match(r"\s*(.*?)\s*(\w+\s*(?:\[[^\]]*\])?)\s*$", base)
        if type_words is None:
            raise ValueError(f"{symbol}: cannot read the field {decl.strip()!r} of struct {name}")
        ctype_decl = type_words.group(1)
        for item in (type_words.group(2), *more):
            field, _, dim = item.strip().partition("[")
            _, ctype = _declarator(f"{ctype_decl} {field}", symbol)
            fields.append(Param(field.strip(), ctype, _eval(dim.rstrip("] "), consts) if dim else 1))
    return tuple(fields)


def _source(module: str, directory: Path) -> tuple[str, str, dict[str, int]]:
    """``directory/<module>.cu`` without comments, the same with the headers it includes before
    it, and the enum constants of all of them."""
    text = _strip((directory / f"{module}.cu").read_text())
    headers: dict[str, str] = {}
    _includes(text, directory, headers)
    consts: dict[str, int] = {}
    for part in (*headers.values(), text):
        _enum_constants(part, consts)
    return text, "\n".join((*headers.values(), text)), consts


@functools.cache
def read_module(module: str, directory: Path) -> tuple[dict[str, KernelSpec], dict[str, int]]:
    """The kernels of ``directory/<module>.cu`` by symbol, and the enum constants of the source
    and the headers it includes (read once per process)."""
    text, everything, consts = _source(module, directory)
    specs: dict[str, KernelSpec] = {}
    for bounds, symbol, plist in _expansions(text):
        symbol = symbol.strip()
        block = _eval(bounds.split(",")[0], consts) if bounds else DEFAULT_BLOCK
        decls = [d for d in plist.split(",") if d.strip()]
        params = tuple(Param(*_declarator(d, symbol)) for d in decls if "*" in d or not _is_struct(d, everything))
        if len(params) == len(decls):
            specs[symbol] = KernelSpec(module, symbol, params, block)
        elif len(decls) == 1:
            name = _QUALIFIERS.sub(" ", decls[0]).split()[0]
            specs[symbol] = KernelSpec(module, symbol, _struct_fields(everything, name, consts, symbol), block, True)
        else:
            raise ValueError(f"{symbol}: a struct parameter must be the only one")
    return specs, consts


def _is_struct(decl: str, text: str) -> bool:
    words = _QUALIFIERS.sub(" ", decl).split()
    return len(words) == 2 and words[0] not in SCALARS and bool(re.search(rf"\bstruct\s+{words[0]}\b", text))


@functools.cache
def read_kernels(directory: Path, modules: Sequence[str]) -> tuple[dict[str, KernelSpec], dict[str, dict[str, int]]]:
    """Every kernel of ``modules`` by symbol, and each module's constants (read once per process)."""
    specs: dict[str, KernelSpec] = {}
    consts: dict[str, dict[str, int]] = {}
    for module in modules:
        found, consts[module] = read_module(module, directory)
        for symbol in found.keys() & specs.keys():
            raise ValueError(f"kernel {symbol} is defined in {specs[symbol].module}.cu and {module}.cu")
        specs.update(found)
    return specs, consts


# ---- the sources of this installation ------------------------------------------------------------------
@functools.cache
def kernel_dir() -> Path:
    """The kernel sources: ``lowgrad/kernels`` in an installed wheel, ``<repo>/kernels`` in a checkout
    (looked up once per process: every kernel lookup goes through here)."""
    package = Path(__file__).resolve().parents[1]  # lowgrad/
    candidates = (package / "kernels", package.parent / "kernels")
    for d in candidates:
        if (d / "add_sr.cu").is_file():
            return d
    raise FileNotFoundError(f"lowgrad kernel sources not found in {' or '.join(map(str, candidates))}")


@functools.cache
def modules() -> tuple[str, ...]:
    """The kernel modules: the stem of every ``.cu`` file in :func:`kernel_dir`, sorted."""
    return tuple(sorted(p.stem for p in kernel_dir().glob("*.cu")))


def kernel_specs() -> dict[str, KernelSpec]:
    """Every kernel entry point by symbol."""
    return read_kernels(kernel_dir(), modules())[0]


def constants(module: str) -> dict[str, int]:
    """The integer enum constants of ``kernels/<module>.cu`` and the headers it includes."""
    if module not in modules():
        raise ValueError(f"unknown kernel module {module!r}; expected one of {', '.join(modules())}")
    return read_module(module, kernel_dir())[1]


def struct_fields(module: str, name: str) -> tuple[Param, ...]:
    """The fields of ``struct <name>`` as ``kernels/<module>.cu`` (with its headers) declares it,
    in order (C lays them out with natural alignment)."""
    _, everything, consts = _source(module, kernel_dir())
    return _struct_fields(everything, name, consts, f"{module}.cu")


def kernel(symbol: str) -> KernelSpec:
    """The entry point ``symbol``; ValueError when no source defines it."""
    spec = kernel_specs().get(symbol)
    if spec is None:
        raise ValueError(f"no kernel {symbol!r} in {kernel_dir()}")
    return spec


def kernel_for(stem: str, *dtypes: Any) -> KernelSpec:
    """The kernel ``stem`` for these dtypes, in the order its symbol names them: the entry point
    ``<stem>_<tag>_<tag>...`` (``f32``, ``bf16``, ``f64``; e.g. ``kernel_for("add_sr", bf16, fp32,
    bf16)`` is ``add_sr_bf16_f32_bf16``). TypeError naming the dtypes when the sources have none."""
    ds = [as_dtype(d) for d in dtypes]
    spec = kernel_specs().get("_".join([stem, *(_TAG.get(d.name, d.name) for d in ds)]))
    if spec is None:
        raise TypeError(f"{stem}: no kernel for dtypes ({', '.join(d.name for d in ds)})")
    return spec
