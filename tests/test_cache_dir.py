"""The kernel cache refuses a cache directory that is a symbolic link or belongs to another user
without touching it or what it points to (no chmod, no read, no write): it compiles in memory with
one warning, and ``doctor``'s check says why. Links above the directory are followed."""
from __future__ import annotations

import os
import re
import stat
import warnings
from pathlib import Path

import pytest
from helpers import counting_compile, needs_nvrtc

from lowgrad.cuda import cache as kcache
from lowgrad.cuda import compiler

SRC = 'extern "C" __global__ void k(float* p) { p[threadIdx.x] = %s; }'
pytestmark = needs_nvrtc  # every test compiles
OTHER_UID = 12345


def filled(d: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[bytes, int]]:
    """``d`` holding a valid entry of a small kernel and a file of the user's, mode 0755 (one the
    cache would tighten if it were used); the process cache cleared. Its snapshot."""
    monkeypatch.setenv("LOWGRAD_CACHE_DIR", str(d))
    compiler.compile_cuda(SRC % "1.0f", "k.cu", "sm_90")
    compiler.clear_memory_cache()
    (d / "notes.txt").write_text("mine")
    os.chmod(d, 0o755)
    return snapshot(d)


def snapshot(d: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of ``d`` with its bytes and modification time, and ``d``'s own mode."""
    out = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in d.iterdir()}
    out["."] = (b"", stat.S_IMODE(os.stat(d).st_mode))
    return out


def refused(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """A compile gives one RuntimeWarning containing ``why``, reads nothing from the cache (the
    kernel is compiled) and says so in doctor's check."""
    calls = counting_compile(monkeypatch)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert compiler.compile_cuda(SRC % "1.0f", "k.cu", "sm_90")[:4] == b"\x7fELF"
    messages = [str(w.message) for w in got]
    assert len(messages) == 1 and why in messages[0] and "compiled in memory" in messages[0], messages
    assert calls == ["k.cu"]
    with pytest.raises(PermissionError, match=re.escape(why)):
        kcache.check_cache()


def test_symlinked_directory_is_refused_and_its_target_untouched(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "target"
    before = filled(target, monkeypatch)
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    monkeypatch.setenv("LOWGRAD_CACHE_DIR", str(link))
    refused(monkeypatch, f"{link} is a symbolic link (to {target})")
    assert snapshot(target) == before  # mode still 0755, no entry read, replaced or added
    assert link.is_symlink()


def test_dangling_symlink_is_refused_and_nothing_is_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    link, target = tmp_path / "link", tmp_path / "nowhere"
    link.symlink_to(target)
    monkeypatch.setenv("LOWGRAD_CACHE_DIR", str(link))
    compiler.clear_memory_cache()
    refused(monkeypatch, "is a symbolic link")
    assert not target.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["link"]


def test_corrected_directory_is_used_after_a_refused_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    monkeypatch.setenv("LOWGRAD_CACHE_DIR", str(tmp_path / "link"))
    compiler.clear_memory_cache()
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        compiler.compile_cuda(SRC % "1.0f", "k.cu", "sm_90")
    assert list(target.iterdir()) == []
    monkeypatch.setenv("LOWGRAD_CACHE_DIR", str(target))
    compiler.clear_memory_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiler.compile_cuda(SRC % "1.0f", "k.cu", "sm_90")
        assert kcache.check_cache().startswith(f"{target}: private, writable, 1 cubins")
    assert len(list(target.glob("k-*.cubin"))) == 1


def test_links_above_the_directory_are_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``~/.cache`` that links to another disk is common: only the directory itself must not be a link."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "home").symlink_to(tmp_path / "disk")
    monkeypatch.setenv("LOWGRAD_CACHE_DIR", str(tmp_path / "home" / "lowgrad"))
    compiler.clear_memory_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiler.compile_cuda(SRC % "1.0f", "k.cu", "sm_90")
    made = tmp_path / "disk" / "lowgrad"
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700 and len(list(made.glob("k-*.cubin"))) == 1


@pytest.mark.parametrize("how", ["another user stands in", "chown"])
def test_directory_of_another_user_is_untouched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    d = tmp_path / "theirs"
    before = filled(d, monkeypatch)
    if how == "chown":
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another uid needs root (the other case covers it without)")
        os.chown(d, OTHER_UID, OTHER_UID)
        for p in d.iterdir():
            os.chown(p, OTHER_UID, OTHER_UID)
        owner = OTHER_UID
    else:
        monkeypatch.setattr(kcache, "_user", lambda: OTHER_UID)
        owner = os.geteuid()
    refused(monkeypatch, f"is owned by uid {owner}, not by this user")
    assert snapshot(d) == before  # mode still 0755, nothing read, replaced or added
