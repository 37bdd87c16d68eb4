"""The native kernel's build and loading never put the process at risk: a missing, truncated,
corrupted or foreign library in the cache is refused before it is loaded (one warning, then
PyTorch's kernels, with right results), a library without a record is probed in a separate
process first, and the build command is public (``attnkit build-kernel``). Each case runs in a
fresh Python process over a temporary cache (loading happens once per process)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from attnkit._backends import native
from attnkit._backends.native import building

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.why_unavailable()}")

# Runs one structured-mask call in the child and compares it with the float64 reference backend.
CHILD = """
import warnings, torch, attnkit
from attnkit import masks
from attnkit._backends import native
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loaded = native.available()
q = torch.randn(1, 2, 64, 8, generator=torch.Generator().manual_seed(0))
out = attnkit.attention(q, q, q, mask=masks.sliding_window(8), backend="tiled")
# float64: torch 2.13's fp32 exp, once SDPA has run in a process, is off by up to 1e-4 in some
# processes on an AVX-512 machine (seen in 2-7 of 40), which an fp32 reference would carry
ref = attnkit.attention(q.double(), q.double(), q.double(), mask=masks.sliding_window(8), backend="reference")
print(loaded, bool(torch.allclose(out.double(), ref, atol=1e-5)), len(caught), "messages:" + "|".join(str(w.message) for w in caught))
"""


def _child(cache, extra_env=None):
    env = {**os.environ, "ATTNKIT_NATIVE_DIR": str(cache), **(extra_env or {})}
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr  # the process survives whatever the cache holds
    loaded, right, warnings, messages = result.stdout.strip().splitlines()[-1].split(" ", 3)
    return loaded == "True", right == "True", int(warnings), messages.removeprefix("messages:")


def _copy_of_the_build(tmp_path):
    """A cache holding a copy of this process's verified build (same source and torch: same name)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    library = native.library_path()
    shutil.copy(library, cache / library.name)
    shutil.copy(building.record_path(library), cache / building.record_path(library).name)
    return cache, cache / library.name


@needs_native
def test_a_verified_build_loads(tmp_path):
    cache, _ = _copy_of_the_build(tmp_path)
    assert _child(cache) == (True, True, 0, "")


@needs_native
@pytest.mark.parametrize("damage", ["truncated", "corrupted", "foreign", "replaced record"])
def test_a_damaged_library_is_refused_with_one_warning_and_the_results_stay_right(tmp_path, damage):
    cache, library = _copy_of_the_build(tmp_path)
    data = library.read_bytes()
    if damage == "truncated":  # a build cut short: loading it in-process can SIGBUS
        library.write_bytes(data[: len(data) // 3])
    elif damage == "corrupted":
        library.write_bytes(data[:5000] + bytes(b ^ 0xFF for b in data[5000:5100]) + data[5100:])
    elif damage == "foreign":  # another shared object under the kernel's name
        library.write_bytes(open(shutil.which("ls") or sys.executable, "rb").read())
    else:  # a record that does not describe these bytes
        record = json.loads(building.record_path(library).read_text())
        record["sha256"] = "0" * 64
        building.record_path(library).write_text(json.dumps(record))
    loaded, right, warnings, message = _child(cache)
    assert (loaded, right, warnings) == (False, True, 1)
    assert "does not match its build record" in message and "attnkit build-kernel" in message


@needs_native
def test_a_library_without_a_record_is_probed_in_another_process_first(tmp_path):
    cache, library = _copy_of_the_build(tmp_path)
    building.record_path(library).unlink()
    assert _child(cache) == (True, True, 0, "")  # the probe passed: loaded, and now recorded
    assert json.loads(building.record_path(library).read_text())["sha256"] == building.file_digest(library)
    # a record nested past json's limit (a RecursionError, not a ValueError, from json) is no record
    building.record_path(library).write_text("[" * 100_000 + "]" * 100_000)
    assert _child(cache) == (True, True, 0, "")
    assert json.loads(building.record_path(library).read_text())["sha256"] == building.file_digest(library)
    # the same for a file that only looks like a library: the probe (not this process) meets it
    library.write_bytes(library.read_bytes()[:2048])
    building.record_path(library).unlink()
    loaded, right, warnings, message = _child(cache)
    assert (loaded, right, warnings) == (False, True, 1) and "probe" in message


def test_no_build_falls_back_and_says_once_how_to_build(tmp_path):
    """A pip install without make: the first structured-mask call the kernel would serve says, in
    one line, how to build it; loading itself warns of nothing."""
    loaded, right, warnings, _ = _child(tmp_path / "empty")
    assert (loaded, right, warnings) == (False, True, 0)
    script = ("import warnings, torch, attnkit\nfrom attnkit import masks\nq = torch.randn(1, 2, 64, 8)\n"
              "with warnings.catch_warnings(record=True) as caught:\n    warnings.simplefilter('always')\n"
              "    for _ in range(3): attnkit.attention(q, q, q, mask=masks.sliding_window(8), backend='tiled')\n"
              "print(len(caught), caught[0].message)")
    env = {**os.environ, "ATTNKIT_NATIVE_DIR": str(tmp_path / "empty")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False)
    count, message = result.stdout.strip().split(" ", 1)
    assert count == "1" and "build it once with: attnkit build-kernel" in message


@needs_native
def test_the_build_command_is_public_and_a_no_op_once_built():
    for command in ([sys.executable, "-m", "attnkit.cli", "build-kernel", "--strict"],
                    [sys.executable, "-m", "attnkit.kernel", "--strict"]):
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr
        assert str(native.library_path()) in result.stdout
    status = subprocess.run([sys.executable, "-m", "attnkit", "build-kernel", "--status"], capture_output=True,
                            text=True, check=False)
    assert status.returncode == 0 and "loaded from" in status.stdout


def test_a_failed_build_is_reported_and_does_not_fail_the_install(tmp_path):
    """No writable cache (or no compiler): the build command says why and exits 0, so `make` goes
    on and the tiled backend uses PyTorch's kernels; with --strict it exits 1."""
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory would go")
    env = {**os.environ, "ATTNKIT_NATIVE_DIR": str(blocked / "native")}
    command = [sys.executable, "-m", "attnkit", "build-kernel"]
    lenient = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    assert lenient.returncode == 0 and "PyTorch's kernels instead" in lenient.stderr
    strict = subprocess.run([*command, "--strict"], capture_output=True, text=True, env=env, check=False)
    assert strict.returncode == 1


def test_the_cache_key_covers_the_torch_build_and_the_compiler(tmp_path, monkeypatch):
    """Another torch build is another file; a verified build is reused by the same compiler only
    (the record names it): with another, the build command compiles again."""
    cache, _ = _copy_of_the_build(tmp_path) if native.available() else (tmp_path, None)
    monkeypatch.setenv("ATTNKIT_NATIVE_DIR", str(cache))
    first = native.library_path()
    with monkeypatch.context() as patch:
        patch.setattr(building, "torch_build", lambda: "2.13.0+another-build")
        assert native.library_path() != first
    if not native.available():
        return
    compiled = []

    def no_compile(arguments, **kwargs):
        compiled.append(arguments)
        raise RuntimeError("compiling")

    recorded = json.loads(building.record_path(first).read_text())["compiler"]
    monkeypatch.setattr(building.subprocess, "run", no_compile)
    monkeypatch.setattr(building, "compiler_identity", lambda command: recorded)
    assert native.build() == first and not compiled  # same compiler: the verified build stands
    monkeypatch.setattr(building, "compiler_identity", lambda command: "/usr/bin/c++: another compiler 99")
    with pytest.raises(RuntimeError, match="compiling"):
        native.build()
    assert compiled and compiled[0][0] == building.compiler()


def test_make_clean_removes_the_cache():
    makefile = open(os.path.join(os.path.dirname(__file__), "..", "Makefile")).read()
    clean = makefile.split("\nclean:")[1].split("\n\n")[0]
    assert "attnkit/native" in clean or "ATTNKIT_NATIVE_DIR" in clean


@pytest.mark.parametrize("capability, switch, wide", [("AVX512", None, True), ("AVX512", "0", False),
                                                      ("AVX2", None, False)])
def test_avx512_builds_only_for_an_avx512_cpu_and_under_another_name(monkeypatch, capability, switch, wide):
    """The forward's 512-bit products are compiled where torch detects AVX-512 (unless switched
    off); the flags are part of the library's name, so another CPU never finds that build."""
    monkeypatch.setattr(building.torch.backends.cpu, "get_cpu_capability", lambda: capability)
    if switch is None:
        monkeypatch.delenv("ATTNKIT_NATIVE_AVX512", raising=False)
    else:
        monkeypatch.setenv("ATTNKIT_NATIVE_AVX512", switch)
    assert ("-mavx512f" in building.flags()) == wide
    assert set(building.FLAGS) <= set(building.flags())
    wide_name = building.library_path()
    monkeypatch.setattr(building.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert (building.library_path() != wide_name) == wide
