"""Shared test fixtures: a per-run random seed (fresh inputs every run, reproducible on demand)."""

import os
import random
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# One base seed per session: fresh by default, fixed with TANDEM_TEST_SEED=<int> to replay a failure.
BASE_SEED = int(os.environ.get("TANDEM_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return f"tandem test seed: {BASE_SEED} (replay with TANDEM_TEST_SEED={BASE_SEED})"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: long-running CPU test")
    config.addinivalue_line("markers", "nvcc(keys=, sources=, archs=): reads the session's nvcc builds "
                                       "(tests/nvcc_builds.py); run last, built meanwhile")


@pytest.fixture
def seed(request) -> int:
    """A seed that differs per test and per run, derived from the session seed and the test id."""
    import zlib
    return (BASE_SEED + zlib.crc32(request.node.nodeid.encode())) % 2**31


def _gpu_ready() -> str | None:
    """None when GPU tests can run, else why not."""
    try:
        import torch
        if not torch.cuda.is_available():
            return "no CUDA device"
        import cupy  # noqa: F401
    except Exception as e:                       # torch without CUDA, or CuPy missing
        return f"GPU stack unavailable ({type(e).__name__}: {e})"
    return None


@pytest.hookimpl(trylast=True)                   # after -k/-m have deselected what will not run
def pytest_collection_modifyitems(config, items):
    if any(it.get_closest_marker("nvcc") is not None for it in items):
        from tests import nvcc_builds
        nvcc_builds.start(config, items)
    gpu_items = [it for it in items if "gpu" in it.keywords]
    if not gpu_items:
        return
    why = _gpu_ready()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {why}")
    for it in gpu_items:
        it.add_marker(skip)


@pytest.fixture(scope="session")
def nvcc_builds(pytestconfig):
    """The session's nvcc builds (tests/nvcc_builds.Builds): .get(source name, arch) -> CompileResult."""
    from tests import nvcc_builds as nb
    if nb.NVCC is None:
        pytest.skip("nvcc not on PATH (needs the CUDA toolkit)")
    return nb._builds(pytestconfig)


def pytest_sessionfinish(session, exitstatus):
    """Stop the nvcc builds and keep ptxas's resource report for the terminal summary and
    <basetemp>/ptxas_report.txt."""
    config = session.config
    if getattr(config, "_tandem_nvcc_builds", None) is None:
        return
    from tests import nvcc_builds
    lines = nvcc_builds.finish(config)
    if lines:
        config._tandem_ptxas_report = lines
        try:
            report = config._tmp_path_factory.getbasetemp() / "ptxas_report.txt"
            report.write_text("\n".join(lines) + "\n")
        except (AttributeError, OSError):
            pass


def gpu_count() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print the ptxas resource report of the session's nvcc builds (tests/nvcc_builds.py), and the
    seed again (-q hides the header; a log's tail then still shows it)."""
    lines = getattr(config, "_tandem_ptxas_report", None)
    if lines:
        terminalreporter.section("ptxas resource usage")
        for line in lines:
            terminalreporter.write_line(line)
    terminalreporter.write_line(f"tandem test seed: {BASE_SEED} (replay with TANDEM_TEST_SEED={BASE_SEED})")


@pytest.fixture
def segment():
    """make(tp, words) -> a fresh mailbox shared-memory segment, unlinked after the test."""
    from multiprocessing import resource_tracker

    from transport.mailbox import create_segment
    made = []

    def make(tp: int, words: int):
        shm = create_segment(tp, words)
        made.append(shm)
        return shm

    yield make
    for shm in made:
        shm.close()
        # attaching a Mailbox (in this process or a spawned child sharing its resource tracker)
        # unregisters the name, since ranks never unlink: register it again so unlink finds it
        resource_tracker.register(shm._name, "shared_memory")  # type: ignore[attr-defined]
        shm.unlink()
