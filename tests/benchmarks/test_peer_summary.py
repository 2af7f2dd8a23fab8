"""peer_summary: rows matched by prompt across files; drops compared on common prompts only."""

import json

import numpy as np
import pytest

from benchmarks.context import peer_summary as ps


def _row(i, methods):
    return {"meta": {"evidence": i}, "answer": f"a{i}", "gold": [i],
            "methods": {m: {"drop1": d[0], "drop3": d[1], "drop5": d[2], "top1": d[3]} for m, d in methods.items()}}


RNG = np.random.default_rng(3)
DROPS = {m: RNG.uniform(0.1, 9, (4, 3)) for m in ("ours", "contextcite_256", "flashtrace")}


def _files():
    cc = {"items": [_row(i, {"contextcite_256": (*DROPS["contextcite_256"][i], i == 0)}) for i in (2, 0, 1)]}
    ft = {"items": [_row(i, {"flashtrace": (*DROPS["flashtrace"][i], True)}) for i in range(4)]}
    ours = {"items": [_row(i, {"ours": (*DROPS["ours"][i], i < 2)}) for i in (3, 1, 0, 2)]}
    return cc, ft, ours


def test_percent_of_reference_on_common_prompts():
    rows = ps.merge(list(_files()))
    v = ps.versus(rows, "ours", "contextcite_256")
    assert v["n"] == 3  # prompt 3 has no ContextCite-256
    want = 100 * DROPS["ours"][:3].mean(0) / DROPS["contextcite_256"][:3].mean(0)
    np.testing.assert_allclose(v["percent"], want)
    assert v["top1"] == [2, 1]
    f = ps.versus(rows, "ours", "flashtrace")
    assert f["n"] == 4
    np.testing.assert_allclose(f["other"], DROPS["flashtrace"].mean(0))
    lines = ps.report(rows, ["ours"])
    assert any(line.startswith("ours vs contextcite_256 (n=3)") for line in lines)
    assert any(line.startswith("ours vs flashtrace (n=4)") for line in lines)


def test_main_prints_and_rejects_bad_json(tmp_path, capsys):
    paths = []
    for name, data in zip(("cc", "ft", "ours"), _files()):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    ps.main([str(paths[0]), str(paths[1]), "--attnroll", str(paths[2])])
    assert "ours vs flashtrace (n=4)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="'items' list"):
        ps.merge([{"rows": []}])


def test_scores_only_rows_give_drop1_from_loo():
    loo = [0.5, 3.0, 0.2, 1.0]
    row = {"meta": {}, "answer": "a", "gold": [1], "loo": loo,
           "scores": {"m": [0.1, 0.2, 0.9, 0.3], "n": [0, 5, 5, 1]}}
    rows = ps.merge([{"items": [row]}])
    key = ps.prompt_key(row)
    assert rows[key]["m"]["drop1"] == 0.2 and not rows[key]["m"]["top1"]
    assert rows[key]["n"]["drop1"] == 3.0 and rows[key]["n"]["top1"]  # tie: the first passage
    assert np.isnan(rows[key]["m"]["drop3"])


def test_measured_drops_are_not_replaced_by_score_only_rows():
    full = _row(0, {"flashtrace": (1.0, 2.0, 3.0, True)})
    scores_only = {**_row(0, {}), "loo": [0.5, 0.1], "scores": {"flashtrace": [0, 1], "ours": [1, 0]}}
    rows = ps.merge([{"items": [full]}, {"items": [scores_only]}])
    key = ps.prompt_key(full)
    assert rows[key]["flashtrace"]["drop3"] == 2.0
    assert rows[key]["ours"]["drop1"] == 0.5
