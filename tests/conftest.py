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


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if "gpu" in it.keywords]
    if not gpu_items:
        return
    why = _gpu_ready()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {why}")
    for it in gpu_items:
        it.add_marker(skip)


def gpu_count() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:
        return 0


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print the ptxas resource report that tests/test_cuda_compile.py leaves on the config, and the
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
