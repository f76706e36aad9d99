"""The docs keep up with the tree: every module is placed in docs/architecture.md (its table and
its layer picture), design.md names every kernel module, every relative link in README.md,
BENCHMARKS.md and docs/ resolves, nothing points outside the repository, and every fenced code
block either runs or says that it does not.

**Code blocks.** The info string after the opening fence says what a block is; its first word is
the language (all GitHub uses for highlighting: the other words are not shown), the others are
marks:

- ```` ```python ```` and ```` ```bash ```` (also ``sh``, ``shell``) **run**, here on the host
  backend: each block alone, in a fresh process with a timeout, in a temporary folder that holds
  links to the repository's top-level entries (so ``python3 tools/x.py`` and ``PYTHONPATH=.``
  work, and files a block writes stay in that folder). A block that fails fails its test, which
  is named ``file:line`` of the opening fence.
- ```` ```python gpu ```` (``bash gpu``) needs a GPU: tests/test_docs_gpu.py runs it in the GPU
  suite; here it is only compiled.
- ```` ```python fragment ```` (any language) is **not run**: a piece that names things defined
  elsewhere, a placeholder such as ``<your loss>``, an install command, a run of minutes.
- ```` ```text ```` is not code: output, diagrams, pseudo-code, a command synopsis.
  ```` ```text output ```` right after a block that runs is that block's stdout, compared exactly.
- A fence with no language, or a language that cannot run here (``cuda``, ``json`` ...) without
  ``fragment``, fails: unmarked blocks are what goes stale. A ``bash`` block that installs
  something (pip, apt) must be a fragment: it is refused unrun.

The mark sits in the info string rather than in an HTML comment on the line before the fence
because it travels with the block (a comment is lost when someone inserts a line or moves the
block), it is visible to whoever edits the block, and it renders cleanly: GitHub (CommonMark)
highlights by the info string's first word and shows none of the rest.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"] + sorted(ROOT.glob("BENCHMARKS.md"))
pytestmark = pytest.mark.skipif(not (ROOT / "docs").is_dir(), reason="no docs/ here (a source archive without them)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _holds_code(path: Path) -> bool:
    """Whether a module holds more than its docstring (a layer's ``__init__.py`` often does not)."""
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body)


def _table_rows(text: str) -> set[str]:
    """The module paths that head a row of a table (``| `cuda/nccl.py` | ...``)."""
    return set(re.findall(r"^\| `([\w/]+\.py)` \|", text, re.MULTILINE))


def test_every_module_has_a_row_in_the_architecture_tables() -> None:
    """docs/architecture.md places every module that holds code (a row of its layer's table), and
    names no module that is gone."""
    rows = _table_rows((ROOT / "docs" / "architecture.md").read_text())
    mods = {str(p.relative_to(ROOT / "lowgrad")): p for p in (ROOT / "lowgrad").rglob("*.py")}
    missing = sorted(m for m, p in mods.items() if _holds_code(p) and m not in rows)
    assert not missing, f"modules without a row in docs/architecture.md: {missing}"
    assert not rows - mods.keys(), f"rows of docs/architecture.md naming no module: {sorted(rows - mods.keys())}"


def test_the_table_check_sees_a_missing_row(tmp_path: Path) -> None:
    """The two helpers find what they look for: a row heads a table line, a docstring is no code."""
    assert _table_rows("| `a/b.py` | x |\nsee `c/d.py`\n| `e.py` | y |") == {"a/b.py", "e.py"}
    doc, code = tmp_path / "doc.py", tmp_path / "code.py"
    doc.write_text('"""Only a docstring."""\n')
    code.write_text('"""A docstring."""\nX = 1\n')
    assert not _holds_code(doc) and _holds_code(code)


def test_relative_links_resolve() -> None:
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


# what the documents cite under benchmarks/: a path, or a file inside a run's archive as
# `benchmarks/<run>/raw.tar.xz:<path>`; a `<...>` placeholder (`benchmarks/<date>-<card>-<runs>/`) cites nothing
BENCH_PATH = re.compile(r"(?<![\w/.-])benchmarks/[\w./:<>-]*")
BENCH_TEXTS = [*DOCS, ROOT / "CHANGELOG.md", *sorted((ROOT / "benchmarks").glob("*/*.md")),
               *sorted((ROOT / "benchmarks").glob("*.md"))]


def cited_benchmark_paths(text: str) -> list[str]:
    return [c.rstrip(".:") for c in BENCH_PATH.findall(text) if "<" not in c]


def missing_benchmark_paths(cited: list[str]) -> list[str]:
    import tarfile

    missing, members = [], {}
    for c in cited:
        path, _, member = c.partition(".tar.xz:")
        if not member:
            if not (ROOT / path).exists():
                missing.append(c)
            continue
        archive = ROOT / (path + ".tar.xz")
        if archive not in members:
            members[archive] = set(tarfile.open(archive).getnames()) if archive.is_file() else set()
        if member not in members[archive]:
            missing.append(c)
    return missing


@pytest.mark.skipif(not (ROOT / "benchmarks" / "runs.json").is_file(), reason="no benchmarks/ here")
def test_cited_benchmark_files_exist() -> None:
    """Every file under benchmarks/ that BENCHMARKS.md, README.md, docs/, CHANGELOG.md or a run's
    notes cite exists, as a file or inside the run's raw.tar.xz: each published figure stays
    traceable to its raw data."""
    cited = {f"{doc.relative_to(ROOT)}: {c}": c for doc in BENCH_TEXTS for c in cited_benchmark_paths(doc.read_text())}
    assert len(cited) > 20 and any(".tar.xz:" in c for c in cited.values())
    missing = set(missing_benchmark_paths(list(cited.values())))
    assert not missing, sorted(k for k, c in cited.items() if c in missing)


def test_benchmark_citations_are_parsed() -> None:
    text = ("see `benchmarks/runs.json`. and benchmarks/<date>-<card>-<runs>/ and "
            "`benchmarks/2026-12-02-h200-run4/raw.tar.xz:nccl_bench.log`, not xbenchmarks/a")
    cited = cited_benchmark_paths(text)
    assert cited == ["benchmarks/runs.json", "benchmarks/2026-12-02-h200-run4/raw.tar.xz:nccl_bench.log"]
    if (ROOT / "benchmarks" / "2026-12-02-h200-run4" / "raw.tar.xz").is_file():
        assert missing_benchmark_paths(cited) == []
        assert missing_benchmark_paths(["benchmarks/2026-12-02-h200-run4/raw.tar.xz:nope.log",
                                        "benchmarks/2026-12-02-h200-run4/nccl_bench.log"]) == [
            "benchmarks/2026-12-02-h200-run4/raw.tar.xz:nope.log", "benchmarks/2026-12-02-h200-run4/nccl_bench.log"]


# the design file and folder that only the developers have (spelled in parts, so that this test
# does not itself name them)
OUTSIDE = ("DESIGN" + ".md", "../" + "shared")


def test_docs_stay_inside_the_repository() -> None:
    for doc in DOCS:
        text = doc.read_text()
        assert not any(name in text for name in OUTSIDE), doc


def test_architecture_import_table_is_the_layer_rule() -> None:
    """The "may import" table of docs/architecture.md says what tests/test_layers.py enforces."""
    from test_layers import ALLOWED

    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("| layer | may import"):]
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        layer_cell, allowed_cell = line.split("|")[1:3]
        layer = re.findall(r"`([a-z_]+)`", layer_cell)
        if layer and layer[0] in ALLOWED:
            rows[layer[0]] = set(re.findall(r"`([a-z_]+)`", allowed_cell.split("—")[0]))
    assert rows == ALLOWED


# --- the modules where the docs list them --------------------------------------------------------

def test_design_names_every_kernel_module() -> None:
    """design.md's list of what ``compile_kernels`` returns is the kernel modules: one per
    ``kernels/*.cu`` (what ``lowgrad.cuda.compiler.modules()`` reads)."""
    text = (ROOT / "docs" / "design.md").read_text()
    listed = re.search(r"compile_kernels\(arch\)`.*?\(modules[^:]*: ([^)]*)\)", text, re.S)
    assert listed, "docs/design.md no longer lists the kernel modules after compile_kernels(arch)"
    named = set(re.findall(r"`(\w+)`", listed.group(1)))
    modules = {p.stem for p in (ROOT / "kernels").glob("*.cu")}
    assert named == modules, (f"docs/design.md's kernel modules: missing {sorted(modules - named)}, "
                              f"not a module {sorted(named - modules)}")


def _layer_box(lines: list[str], label: str) -> set[str]:
    """The words inside the box of the layer picture whose first line starts with ``label``."""
    for i, line in enumerate(lines):
        col = line.find(f"| {label}")
        if col < 0:
            continue
        right = line.index("|", col + 1)
        words: set[str] = set()
        for row in lines[i:]:
            if row[col:col + 1] != "|":
                break
            words |= set(re.findall(r"[a-z_]+", row[col + 1:right]))
        return words
    raise AssertionError(f"the layer picture of docs/architecture.md has no box {label!r}")


def test_architecture_picture_names_every_module() -> None:
    """Each folder's box in the layer picture names every module of that folder, and the
    picture names the top-level modules."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("## The layers")
    picture = next(b for b in parse_blocks(ROOT / "docs" / "architecture.md") if b.offset > start)
    lines = picture.code.splitlines()
    pkg = ROOT / "lowgrad"
    missing = []
    for folder in sorted(p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()):
        box = _layer_box(lines, f"{folder}/")
        missing += [f"{folder}/{p.stem}" for p in sorted((pkg / folder).glob("*.py"))
                    if p.stem != "__init__" and p.stem not in box]
    missing += [p.name for p in sorted(pkg.glob("*.py")) if p.name not in picture.code]
    assert not missing, f"docs/architecture.md's layer picture (line {picture.line}) does not name: {missing}"


# --- fenced code blocks ---------------------------------------------------------------------------

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
RUNNERS = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
NOT_CODE = {"text"}
MARKS = {"fragment", "gpu", "output"}
# the optional parts a block may import (an install without them skips the block, naming them)
OPTIONAL = {"torch": "the torch extra", "transformers": "pip install transformers", "matplotlib": "the plot extra"}
INSTALLS = re.compile(r"\b(pip3?|python3? -m pip|uv pip|apt(-get)?|conda|brew)\b[^\n]*\binstall\b")
HINT = ("Mark a block that is not meant to run: ```python fragment (or bash fragment, ...); ```text for "
        "output, diagrams and pseudo-code; ```python gpu for a block that needs a GPU "
        "(tests/test_docs.py says more).")
CODE_DOCS = DOCS  # README.md, BENCHMARKS.md and docs/*.md


@dataclass(frozen=True)
class Block:
    """One fenced block: where its opening fence is, its info string and its content (the
    fence's indentation removed)."""

    path: Path
    line: int  # 1-based line of the opening fence
    offset: int  # character offset of the opening fence
    info: str
    code: str
    closed: bool = True

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def lang(self) -> str:
        words = self.info.split()
        return words[0] if words else ""

    @property
    def marks(self) -> set[str]:
        return set(self.info.split()[1:])

    @property
    def first_line(self) -> str:
        return next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")


def parse_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file (CommonMark fences: three or more backticks or
    tildes; the closing fence has the same character and at least the same length)."""
    lines = path.read_text().splitlines(keepends=True)
    out: list[Block] = []
    i = 0
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln))
    while i < len(lines):
        m = FENCE.match(lines[i].rstrip("\n"))
        if not m or (m.group(2)[0] == "`" and "`" in m.group(3)):
            i += 1
            continue
        indent, fence, info = len(m.group(1).expandtabs()), m.group(2), m.group(3).strip()
        close = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body, j = [], i + 1
        while j < len(lines) and not close.match(lines[j].rstrip("\n")):
            ln = lines[j].expandtabs()
            strip = min(indent, len(ln) - len(ln.lstrip(" ")))
            body.append(ln[strip:])
            j += 1
        out.append(Block(path, i + 1, offsets[i], info, "".join(body), closed=j < len(lines)))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for doc in CODE_DOCS for b in parse_blocks(doc)]


def output_of(block: Block) -> Block | None:
    """The ```text output block right after ``block`` in its file, if any."""
    blocks = parse_blocks(block.path)
    i = next(k for k, b in enumerate(blocks) if b.line == block.line)
    nxt = blocks[i + 1] if i + 1 < len(blocks) else None
    return nxt if nxt is not None and nxt.lang == "text" and "output" in nxt.marks else None


def judge(block: Block) -> tuple[str, str]:
    """(kind, why): kind is "run", "gpu", "fragment", "text" or "bad" (``why`` says what is wrong)."""
    if not block.closed:
        return "bad", "the fence is never closed"
    if not block.lang:
        return "bad", "unmarked block (no language after the fence)"
    unknown = block.marks - MARKS
    if unknown:
        return "bad", f"unknown word(s) {sorted(unknown)} after the language (the marks are {sorted(MARKS)})"
    if block.lang in NOT_CODE:
        if "output" in block.marks:
            blocks = parse_blocks(block.path)
            i = next(k for k, b in enumerate(blocks) if b.line == block.line)
            before = blocks[i - 1] if i else None
            if before is None or judge(before)[0] not in ("run", "gpu"):
                return "bad", "a ```text output block must come right after a block that runs"
        return "text", ""
    if "fragment" in block.marks:
        return "fragment", ""
    if "output" in block.marks:
        return "bad", "only a ```text block can be an output"
    if block.lang not in RUNNERS:
        return "bad", f"a ```{block.lang} block cannot run here: mark it ```{block.lang} fragment"
    if RUNNERS[block.lang] == "bash" and INSTALLS.search(block.code):
        return "bad", "it installs something: such a block must be a ```bash fragment (refused unrun)"
    return ("gpu" if "gpu" in block.marks else "run"), ""


def run_block(block: Block, tmp_path: Path, timeout: float) -> None:
    """Run a block alone in a fresh process, in a folder of links to the repository's top-level
    entries; fail with the block's file and line when it exits non-zero, times out, or prints
    something other than its ```text output block."""
    work = tmp_path / "doc-block"
    work.mkdir(parents=True)
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv", "__pycache__") and not entry.name.startswith(".pytest"):
            (work / entry.name).symlink_to(entry)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
               MPLBACKEND="Agg")
    env.pop("LOWGRAD_TRACE", None)
    if RUNNERS[block.lang] == "python":
        script = work / "_doc_block.py"
        cmd = [sys.executable, str(script)]
    else:
        script = work / "_doc_block.sh"
        cmd = ["bash", "-e", "-o", "pipefail", str(script)]
    script.write_text(block.code)
    what = f"{block.where}: the ```{block.info} block"
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=work, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not finish in {timeout:.0f} s. {HINT}", pytrace=False)
    if res.returncode != 0:
        tail = "\n".join((res.stderr or res.stdout).rstrip().splitlines()[-25:])
        pytest.fail(f"{what} exited with status {res.returncode}:\n{tail}\n{HINT}", pytrace=False)
    want = output_of(block)
    if want is not None and res.stdout != want.code:
        pytest.fail(f"{what} printed\n{res.stdout}\nbut its ```text output block ({want.where}) says\n{want.code}",
                    pytrace=False)


def block_params(kinds: set[str]) -> list:
    out = []
    for b in all_blocks():
        if judge(b)[0] in kinds:
            out.append(pytest.param(b, id=b.where))
    return out


@pytest.mark.parametrize("block", block_params({"run", "gpu", "fragment", "text", "bad"}))
def test_doc_code_block(block: Block, tmp_path: Path) -> None:
    """Every fenced block of README.md, BENCHMARKS.md and docs/*.md: a runnable one runs (a
    ```python gpu one only compiles here), a fragment or text block is left alone, an unmarked
    one fails. The test's id is the file and line of the block's opening fence."""
    kind, why = judge(block)
    if kind == "bad":
        pytest.fail(f"{block.where}: ```{block.info}: {why}. {HINT}", pytrace=False)
    if kind == "gpu" and RUNNERS[block.lang] == "python":
        compile(block.code, block.where, "exec")
    if kind == "run":
        missing = [m for m in optional_imports(block) if importlib.util.find_spec(m) is None]
        if missing:
            pytest.skip(f"{block.where} imports {', '.join(missing)}, not installed here "
                        f"({'; '.join(OPTIONAL[m] for m in missing)})")
        run_block(block, tmp_path, timeout=120)


def optional_imports(block: Block) -> list[str]:
    """The :data:`OPTIONAL` packages a python block imports (none for a bash block)."""
    if RUNNERS[block.lang] != "python":
        return []
    modules = set()
    for node in ast.walk(ast.parse(block.code)):
        if isinstance(node, ast.Import):
            modules |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module)
    # lowgrad.torch is the adapter: it needs torch
    names = {"torch" if m.startswith("lowgrad.torch") else m.split(".")[0] for m in modules}
    return sorted(names & set(OPTIONAL))


def test_block_parser_finds_fences_and_marks(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("text\n\n```python fragment\nx = 1\n```\n\n- item\n\n  ```\n  plain\n  ```\n\n"
                   "````text\n```\nnested\n```\n````\n\n```python\nprint(1)\n```\n\n```text output\n1\n```\n")
    blocks = parse_blocks(doc)
    assert [(b.line, b.lang, sorted(b.marks)) for b in blocks] == [
        (3, "python", ["fragment"]), (9, "", []), (13, "text", []), (19, "python", []), (23, "text", ["output"])]
    assert blocks[1].code == "plain\n" and blocks[2].code == "```\nnested\n```\n"
    assert [judge(b)[0] for b in blocks] == ["fragment", "bad", "text", "run", "text"]
    assert output_of(blocks[3]) == blocks[4]


def test_block_runner_names_file_and_line(tmp_path: Path) -> None:
    """A block that fails reports where it is; an output block is compared."""
    doc = ROOT / "docs" / "x.md"  # a path under ROOT for the message; never written
    bad = Block(doc, 7, 0, "python", "raise SystemExit('boom')\n")
    with pytest.raises(pytest.fail.Exception, match=r"docs/x.md:7: the ```python block exited with status 1:\nboom"):
        run_block(bad, tmp_path / "a", timeout=60)
    install = Block(doc, 9, 0, "bash", "pip install lowgrad\n")
    assert judge(install)[0] == "bad"


# --- BENCHMARKS.md's summary ----------------------------------------------------------------------

def _summarize():
    import importlib.util

    spec = importlib.util.spec_from_file_location("summarize", ROOT / "tools" / "summarize_benchmarks.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


benchmarks_here = pytest.mark.skipif(not (ROOT / "benchmarks" / "runs.json").is_file(),
                                     reason="no benchmarks/ here (a source archive without them)")


@benchmarks_here
def test_benchmarks_holds_records_not_code() -> None:
    """benchmarks/ is data: each run's commands are text in its record (``run<NN>-commands.txt``),
    and the one tool that reads the records is tools/summarize_benchmarks.py."""
    code = [str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*")
            if p.is_file() and (p.suffix in (".py", ".sh") or os.access(p, os.X_OK))]
    assert not code, f"code under benchmarks/ (keep a record's commands as text): {code}"


@benchmarks_here
def test_benchmarks_summary_is_what_the_runs_give() -> None:
    """The table at the top of BENCHMARKS.md is tools/summarize_benchmarks.py's output for the committed
    runs, to the character: edit benchmarks/runs.json or the run files, then regenerate."""
    s = _summarize()
    committed = s.committed_block((ROOT / "BENCHMARKS.md").read_text())
    assert committed == s.render(), ("BENCHMARKS.md's summary is not what benchmarks/runs.json gives: "
                                     "run `python tools/summarize_benchmarks.py` and commit the result")


@benchmarks_here
def test_benchmarks_summary_takes_the_newest_run(tmp_path: Path) -> None:
    """A later run that measured the same thing replaces the earlier one's row, commit included."""
    s = _summarize()
    runs = json.loads((ROOT / "benchmarks" / "runs.json").read_text())
    newest = max((r for r in runs["runs"] if "manager" in r["sources"]), key=lambda r: r["run"])
    later = dict(newest, run=max(r["run"] for r in runs["runs"]) + 1, commit="abcdef0",
                 sources={"manager": newest["sources"]["manager"]})
    later.pop("commit_note", None)
    runs["runs"].append(later)
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    for r in runs["runs"]:
        if not (tmp_path / r["folder"]).exists():
            (tmp_path / r["folder"]).symlink_to(ROOT / "benchmarks" / r["folder"])
    table = s.render(s.Runs(tmp_path))
    manager_rows = [ln for ln in table.splitlines() if ln.startswith("| Gradient manager micro-step")]
    assert manager_rows and all(ln.endswith(f"| {later['run']} · {later['date']} · H200 · `abcdef0` |")
                                for ln in manager_rows)
    assert sum("`abcdef0`" in ln for ln in table.splitlines()) == len(manager_rows)
