"""One pool of nvcc builds for the CPU-side CUDA checks (tests/test_cuda_compile.py, the dependent-launch
scan in tests/test_launch.py): each (source, architecture) is compiled once per session, with the options
the runtime gives NVRTC, to a cubin with ptxas's resource report (`-Xptxas -v`) and the PTX nvcc made on
the way (`-keep`).

nvcc is most of the suite's CPU time (gemv.cu alone takes ~100 s per architecture on a CI-class machine),
so tests/conftest.py starts every build the collected tests need as soon as collection ends, at a lower
scheduling priority (`nice`), and moves the tests that read them to the end of the run: the compiles use
what the rest of the suite leaves of the CPU instead of making it wait. Results are kept in pytest's cache
directory under a key made of every file in kernels/cuda/, the options, the architecture and nvcc's
version, so a second local run compiles only what changed (a fresh checkout, as in CI, compiles all).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kernels.launch import COMPILE_OPTIONS, CUDA_DIR, source_files

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_120a")      # A100 to Blackwell consumer boards
NVCC = shutil.which("nvcc")
NICE = shutil.which("nice")
SOURCES = source_files()
_CACHE_VERSION = 1


def nvcc_command(src: Path, arch: str, out: Path, keep_dir: Path | None = None) -> list[str]:
    cmd = [NVCC or "nvcc", *COMPILE_OPTIONS, f"-I{CUDA_DIR}", "-cubin", "-Xptxas", "-v", f"-arch={arch}",
           "-o", str(out), str(src)]
    if keep_dir is not None:
        cmd[1:1] = ["-keep", "-keep-dir", str(keep_dir)]
    return cmd


@dataclass
class KernelUsage:
    name: str
    registers: int = 0
    smem: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    entry: bool = False


@dataclass
class CompileResult:
    name: str                   # the source's file name
    arch: str
    returncode: int
    log: str                    # nvcc's stdout and stderr (ptxas -v's report among them)
    ptx: str                    # the PTX ptxas compiled ('' when nvcc failed before it)
    seconds: float              # wall time of the compile (0 when it came from the cache)
    kernels: dict[str, KernelUsage] = field(default_factory=dict)


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict[str, KernelUsage]:
    """Per-function resource usage from `ptxas -v` output."""
    out: dict[str, KernelUsage] = {}
    cur: KernelUsage | None = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            cur = out.setdefault(m.group(1), KernelUsage(m.group(1)))
            cur.entry = True
        elif m := _PROPS.search(line):
            cur = out.setdefault(m.group(1), KernelUsage(m.group(1)))
        elif cur is not None and (m := _FRAME.search(line)):
            cur.stack, cur.spill_stores, cur.spill_loads = (int(g) for g in m.groups())
        elif cur is not None and (m := _USED.search(line)):
            cur.registers = int(m.group(1))
            if s := _SMEM.search(line):
                cur.smem = int(s.group(1))
    return out


def _nvcc_version() -> str:
    try:
        return subprocess.run([NVCC or "nvcc", "--version"], capture_output=True, text=True).stdout
    except OSError:
        return ""


class Builds:
    """(source name, arch) -> Future[CompileResult], each compile started at most once."""

    def __init__(self, workdir: Path, cache_dir: Path | None, workers: int):
        self.workdir = workdir
        self.cache_dir = cache_dir
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nvcc")
        self.futures: dict[tuple[str, str], Future] = {}
        self._running: set[subprocess.Popen] = set()
        # the environment as it is when the pool starts (collection): the compiles run while tests
        # monkeypatch os.environ, and a compile must not carry a test's variables (a test that kills
        # every process holding its tag would kill the compile too)
        self._env = dict(os.environ)
        self._lock = threading.Lock()
        self._closing = False
        digest = hashlib.sha256(f"{_CACHE_VERSION}\0{_nvcc_version()}\0{COMPILE_OPTIONS}".encode())
        for path in sorted(CUDA_DIR.iterdir()):                         # sources and the headers they include
            if path.is_file():
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
        self._tree_key = digest.hexdigest()
        self._prune_cache()

    def submit(self, name: str, arch: str) -> Future:
        key = (name, arch)
        if key not in self.futures:
            self.futures[key] = self.pool.submit(self._build, name, arch)
        return self.futures[key]

    def get(self, name: str, arch: str) -> CompileResult:
        return self.submit(name, arch).result()

    def done(self) -> list[CompileResult]:
        return [f.result() for _, f in sorted(self.futures.items())
                if f.done() and not f.cancelled() and f.exception() is None]

    def close(self) -> None:
        """Cancel the builds not started and stop the running ones (a run cut short by -x or ^C does
        not wait minutes for compiles nobody reads)."""
        with self._lock:
            self._closing = True
            for proc in self._running:                                  # nvcc and its cicc / ptxas
                for pid in _process_tree(proc.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, cmd: list[str]) -> tuple[int, str]:
        with self._lock:
            if self._closing:
                return -9, "not built: the session ended first"
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self._env)
            self._running.add(proc)
        try:
            out, _ = proc.communicate()
        finally:
            with self._lock:
                self._running.discard(proc)
        return proc.returncode, out

    def _cache_file(self, name: str, arch: str) -> Path | None:
        if self.cache_dir is None:
            return None
        return self.cache_dir / self._tree_key[:32] / f"{Path(name).stem}.{arch}.json"

    def _prune_cache(self) -> None:
        """Keep the builds of the current tree only (an edited source makes every earlier one stale)."""
        if self.cache_dir is None:
            return
        for old in self.cache_dir.iterdir():
            if old.is_dir() and old.name != self._tree_key[:32]:
                shutil.rmtree(old, ignore_errors=True)
        (self.cache_dir / self._tree_key[:32]).mkdir(parents=True, exist_ok=True)

    def _build(self, name: str, arch: str) -> CompileResult:
        cached = self._cache_file(name, arch)
        if cached is not None and cached.exists():
            try:
                d = json.loads(cached.read_text())
                return CompileResult(name, arch, d["returncode"], d["log"], d["ptx"], 0.0, parse_ptxas(d["log"]))
            except (OSError, ValueError, KeyError):
                pass                                                    # unreadable: compile again
        keep = Path(tempfile.mkdtemp(prefix=f"{Path(name).stem}.{arch}.", dir=self.workdir))
        cmd = nvcc_command(CUDA_DIR / name, arch, keep / "out.cubin", keep)
        if NICE:
            cmd = [NICE, "-n", "10", *cmd]
        t0 = time.perf_counter()
        for attempt in range(3):
            try:
                returncode, log = self._run(cmd)
                break
            except OSError as e:
                # starting nvcc failed (seen once on a CI-class machine: EFAULT from exec while many compiles
                # started at once): not a verdict on the source, so try again
                if e.errno not in (errno.EFAULT, errno.EAGAIN, errno.ENOMEM) or attempt == 2:
                    raise
                time.sleep(1.0)
        seconds = time.perf_counter() - t0
        ptx_file = keep / f"{Path(name).stem}.ptx"
        ptx = ptx_file.read_text() if ptx_file.exists() else ""
        shutil.rmtree(keep, ignore_errors=True)                         # the preprocessed sources are large
        if cached is not None and returncode == 0:
            try:
                tmp = cached.with_suffix(".tmp")
                tmp.write_text(json.dumps({"returncode": returncode, "log": log, "ptx": ptx}))
                tmp.replace(cached)
            except OSError:
                pass
        return CompileResult(name, arch, returncode, log, ptx, seconds, parse_ptxas(log))


def _process_tree(pid: int) -> list[int]:
    """pid and its descendants, parents first (Linux /proc; just pid elsewhere). The compiles stay in
    pytest's process group, so a ^C reaches them directly; this is for stopping them from close()."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo.extend(int(c) for c in task.read_text().split())
            except (OSError, ValueError):
                pass
    return out


def item_keys(item) -> list[tuple[str, str]]:
    """The (source name, arch) builds a collected test reads, from its `nvcc` marker: `keys=[...]`, or
    `sources=`/`archs=` (all by default), narrowed by the test's own `src`/`arch` parameters."""
    mark = item.get_closest_marker("nvcc")
    if mark is None:
        return []
    if "keys" in mark.kwargs:
        return list(mark.kwargs["keys"])
    params = item.callspec.params if hasattr(item, "callspec") else {}
    names = [params["src"].name] if "src" in params else list(mark.kwargs.get("sources", [s.name for s in SOURCES]))
    archs = [params["arch"]] if "arch" in params else list(mark.kwargs.get("archs", ARCHS))
    return [(n, a) for n in names for a in archs]


def start(config, items) -> None:
    """Move the tests that read nvcc builds to the end and start their builds, largest source first."""
    users = [it for it in items if it.get_closest_marker("nvcc") is not None]
    if not users or NVCC is None:
        return
    items[:] = [it for it in items if it.get_closest_marker("nvcc") is None] + users
    keys = {k for it in users for k in item_keys(it)}
    builds = _builds(config)
    size = {s.name: s.stat().st_size for s in SOURCES}
    for name, arch in sorted(keys, key=lambda k: (-size.get(k[0], 0), k)):
        builds.submit(name, arch)


def _builds(config) -> Builds:
    builds = getattr(config, "_tandem_nvcc_builds", None)
    if builds is None:
        workdir = Path(tempfile.mkdtemp(prefix="tandem-nvcc-"))
        cache_dir = None
        if getattr(config, "cache", None) is not None and not os.environ.get("TANDEM_NVCC_NO_CACHE"):
            cache_dir = config.cache.mkdir("tandem-nvcc")
        builds = Builds(workdir, cache_dir, workers=max(2, os.cpu_count() or 2))
        config._tandem_nvcc_builds = builds
    return builds


def finish(config) -> list[str]:
    """Stop the pool (cancelling builds no test asked for any more) and return the ptxas report lines of
    every finished build; the workdir goes."""
    builds: Builds | None = getattr(config, "_tandem_nvcc_builds", None)
    if builds is None:
        return []
    builds.close()
    shutil.rmtree(builds.workdir, ignore_errors=True)
    lines = []
    for res in builds.done():
        for k in sorted(res.kernels.values(), key=lambda k: k.name):
            if k.entry:
                lines.append(f"{res.name:<16} {res.arch:<8} {k.name:<40} {k.registers:>3} regs {k.smem:>6} B smem "
                             f"{k.stack:>4} B stack {k.spill_stores:>4}/{k.spill_loads} B spill st/ld")
    return lines
