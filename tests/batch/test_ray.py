"""The Ray Data engine gives the same rows as the local engine, and resumes what another run left. One Ray
runtime for the whole module (starting one costs seconds); run_batch uses it instead of starting its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pq = pytest.importorskip("pyarrow.parquet")
ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from attnroll.batch import list_items, read_batch, read_manifest, run_batch  # noqa: E402

from .helpers import assert_same_rows, write_shapes  # noqa: E402

pytestmark = pytest.mark.slow  # a real Ray runtime, and a Ray run killed in a subprocess


@pytest.fixture(scope="module")
def ray_runtime():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def test_ray_engine_gives_the_local_rows_and_resumes(ray_runtime, tmp_path):
    src = tmp_path / "shapes"
    write_shapes(src, 40)
    local = run_batch(src, tmp_path / "local", methods=["rollout", "gae"], batch_size=8)
    on_ray = run_batch(src, tmp_path / "ray", methods=["rollout", "gae"], batch_size=8, engine="ray", num_workers=2)
    assert local.explained == on_ray.explained == 40
    assert_same_rows(read_batch(tmp_path / "local"), read_batch(tmp_path / "ray"))
    assert read_manifest(tmp_path / "ray")["engine"] == "ray"
    # Lose two committed shards: the rerun on Ray explains exactly those.
    shards = sorted((tmp_path / "ray" / "rows").glob("part-*.parquet"))
    lost = sum(pq.ParquetFile(p).metadata.num_rows for p in shards[1:3]) // 2
    for p in shards[1:3]:
        p.unlink()
    again = run_batch(src, tmp_path / "ray", methods=["rollout", "gae"], batch_size=8, engine="ray", num_workers=2)
    assert again.explained == lost and again.done_before == 40 - lost
    assert_same_rows(read_batch(tmp_path / "local"), read_batch(tmp_path / "ray"))


def test_num_gpus_and_target_reach_map_batches(ray_runtime, tmp_path, monkeypatch):
    """Without a GPU: the options run_batch hands to Ray Data's map_batches (recorded, then the run stopped
    before an actor would wait for a GPU that this machine does not have)."""
    src = tmp_path / "shapes"
    write_shapes(src, 4)
    seen = {}

    class Stop(Exception):
        pass

    def record(self, fn, **kwargs):
        seen.update(kwargs, fn=fn)
        raise Stop

    monkeypatch.setattr(ray.data.Dataset, "map_batches", record)
    with pytest.raises(Stop):
        run_batch(src, tmp_path / "o", engine="ray", num_workers=2, num_gpus=0.5, target=1, batch_size=2)
    assert seen["num_gpus"] == 0.5 and seen["compute"].max_size == 2 and seen["batch_size"] == 1  # a row per batch
    assert seen["fn_constructor_kwargs"]["num_gpus"] == 0.5 and seen["fn_constructor_kwargs"]["job"].target == 1
    assert seen["max_restarts"] == 0  # one machine: a dead actor is not restarted (the rerun resumes)


def session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` (the killed run's driver, its Ray runtime and its actors)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def test_kill_9_of_a_ray_run_then_rerun_gives_every_input_once(ray_runtime, tmp_path):
    """The real `attnroll batch --engine ray` (its own Ray runtime, one actor running three calls at once) is
    killed with everything it started; the rerun on Ray explains exactly the inputs no shard holds."""
    src = tmp_path / "shapes"
    write_shapes(src, 40)
    out = tmp_path / "o"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "attnroll.commands", "batch", str(src), "--out", str(out), "-m", "rollout",
           "--batch-size", "1", "--engine", "ray", "--cpus-per-worker", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 300  # generous: Ray starts in seconds, the machine may be shared
        while time.time() < deadline and proc.poll() is None:
            if (out / "rows").is_dir() and len(list((out / "rows").glob("part-*.parquet"))) >= 3:
                break
            time.sleep(0.01)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, its Ray runtime and the actor: one process group
        proc.wait()
    deadline = time.time() + 60
    while session_pids(proc.pid) and time.time() < deadline:  # anything Ray moved to another group
        for pid in session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    committed = len(read_batch(out))
    assert 3 <= committed < 40 and read_manifest(out)["status"] == "running"
    again = run_batch(src, out, methods=["rollout"], batch_size=4, engine="ray")
    assert again.done_before == committed and again.explained == 40 - committed
    df = read_batch(out)
    assert sorted(df["id"]) == sorted(it.id for it in list_items(src))  # every input exactly once
    run_batch(src, tmp_path / "local", methods=["rollout"], batch_size=40)
    assert_same_rows(read_batch(tmp_path / "local"), df, atol=2e-6)
