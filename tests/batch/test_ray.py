"""The Ray Data engine gives the same rows as the local engine, and resumes what another run left. One Ray
runtime for the whole module (starting one costs seconds); run_batch uses it instead of starting its own."""

from __future__ import annotations

import pytest

pq = pytest.importorskip("pyarrow.parquet")
ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from attnroll.batch import read_batch, read_manifest, run_batch  # noqa: E402

from .helpers import assert_same_rows, write_shapes  # noqa: E402


@pytest.fixture(scope="module")
def ray_runtime():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
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
    assert seen["num_gpus"] == 0.5 and seen["compute"].max_size == 2 and seen["batch_size"] == 2
    assert seen["fn_constructor_kwargs"]["num_gpus"] == 0.5 and seen["fn_constructor_kwargs"]["job"].target == 1
    assert seen["max_restarts"] == 0  # one machine: a dead actor is not restarted (the rerun resumes)
