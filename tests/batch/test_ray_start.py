"""The Ray runtime starting in the background (engines.RayStart), without starting Ray: a recording stand-in for
``start_ray`` and ``ray.shutdown``. The runtime is stopped by the thread that started it (Ray's processes die
with the thread that spawned them), what starting raised reaches the caller, and a run that stops before
Ray's part (a bad source, a mismatched output) still stops the runtime it began."""

from __future__ import annotations

import threading

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from attnroll.batch import BatchMismatchError, run_batch  # noqa: E402
from attnroll.batch import engines  # noqa: E402
from attnroll.batch.engines import RayStart, ray_cpus  # noqa: E402

from .helpers import write_shapes  # noqa: E402


@pytest.fixture
def fake_runtime(monkeypatch):
    """start_ray and ray.shutdown replaced by recorders: which thread started, which stopped, with what."""
    seen: dict = {"starts": [], "stops": []}

    def start(ray_mod, address, num_cpus):
        seen["starts"].append((threading.get_ident(), address, num_cpus))
        return not seen.get("running_already", False)

    monkeypatch.setattr(engines, "start_ray", start)
    monkeypatch.setattr(ray, "shutdown", lambda: seen["stops"].append(threading.get_ident()))
    return seen


def test_the_thread_that_started_the_runtime_stops_it(fake_runtime):
    rs = RayStart(None, 3)
    assert rs.wait() is True
    assert fake_runtime["stops"] == []  # running until stop()
    rs.stop()
    rs.stop()  # idempotent
    (starter, address, cpus), = fake_runtime["starts"]
    assert (address, cpus) == (None, 3)
    assert fake_runtime["stops"] == [starter] and starter != threading.get_ident()


def test_a_runtime_running_already_is_left_running(fake_runtime):
    fake_runtime["running_already"] = True
    rs = RayStart("10.0.0.1:6379", 1)
    assert rs.wait() is False
    rs.stop()
    assert fake_runtime["stops"] == []


def test_what_starting_raised_reaches_the_caller(monkeypatch):
    def fail(ray_mod, address, num_cpus):
        raise ConnectionError(f"no cluster at {address}")

    monkeypatch.setattr(engines, "start_ray", fail)
    rs = RayStart("nowhere:1", 1)
    with pytest.raises(ConnectionError, match="no cluster at nowhere:1"):
        rs.wait()
    rs.stop()


def test_cpus_per_actor_default_to_the_machine_shared_or_one_on_a_cluster(monkeypatch):
    monkeypatch.setattr(engines.os, "cpu_count", lambda: 8)
    assert [ray_cpus(None, k, None) for k in (1, 2, 3, 16)] == [8, 4, 2, 1]
    assert ray_cpus("head:6379", 4, None) == 1 and ray_cpus(None, 2, 3) == 3


def test_a_run_that_stops_before_ray_stops_the_runtime_it_began(fake_runtime, tmp_path):
    with pytest.raises(ValueError, match="source"):
        run_batch(tmp_path / "missing", tmp_path / "o", engine="ray", num_workers=2, cpus_per_worker=1)
    assert [s[1:] for s in fake_runtime["starts"]] == [(None, 2)]  # begun before the source was listed
    assert fake_runtime["stops"] == [fake_runtime["starts"][0][0]]
    # An output of another run: refused, and the runtime begun for it stopped too.
    src = tmp_path / "shapes"
    write_shapes(src, 2)
    run_batch(src, tmp_path / "o", methods=["rollout"])  # the local engine: no runtime
    assert len(fake_runtime["starts"]) == 1
    with pytest.raises(BatchMismatchError):
        run_batch(src, tmp_path / "o", methods=["raw"], engine="ray")
    assert len(fake_runtime["stops"]) == 2 and fake_runtime["stops"][1] == fake_runtime["starts"][1][0]


def test_a_caller_s_runtime_start_is_used_and_stopped(fake_runtime, tmp_path):
    rs = RayStart(None, 2)
    with pytest.raises(ValueError, match="source"):
        run_batch(tmp_path / "missing", tmp_path / "o", engine="ray", ray_start=rs)
    assert len(fake_runtime["starts"]) == 1 and fake_runtime["stops"] == [fake_runtime["starts"][0][0]]
