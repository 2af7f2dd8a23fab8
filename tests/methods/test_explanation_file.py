"""Explanation files: metadata that contradicts the arrays is refused on load, naming the file and the entry
(prefix / suffix outside the row, units that do not add up, a grid of another size, per-example entries of
another count, layers / mask / readout weights of other shapes, non-floating scores); bfloat16 arrays save
(as float32, their dtype recorded) and load back as bfloat16."""

import json

import numpy as np
import pytest
import torch

from attnroll import Explanation


def image_expl(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    full = torch.rand(2, 7, generator=g).to(dtype)  # prefix 1 + 2x3 grid
    return Explanation(scores=full[:, 1:].clone(), full_row=full, layers=torch.rand(2, 2, 7, generator=g).to(dtype),
                       grid=(2, 3), prefix=1, method="rollout", options={"alpha": 0.5}, target=[1, 0],
                       positions=[0, 0], attention_mask=torch.ones(2, 7, dtype=torch.int64),
                       readout={"kind": "cls", "source": "test", "positions": [0, 0]},
                       readout_weights=torch.eye(7)[:1].repeat(2, 1).to(dtype),
                       extra={"heads": torch.rand(2, 3, 7, generator=g).to(dtype), "note": "x"})


def text_expl():
    full = torch.tensor([[0.1, 0.5, 0.4], [0.2, 0.8, 0.0]])
    tokens = [["[CLS]", "cat", "[SEP]"], ["[CLS]", "dog", "[PAD]"]]
    return Explanation(scores=full.clone(), full_row=full, tokens=tokens, method="raw", positions=[0, 0])


def tamper(path, out, meta=None, arrays=None):
    """A copy of the file at ``out`` with some metadata entries / arrays replaced (None removes an array)."""
    with np.load(path, allow_pickle=False) as z:
        parts = {k: z[k] for k in z.files}
    m = json.loads(str(parts["__meta__"]))
    m.update(meta or {})
    parts["__meta__"] = np.array(json.dumps(m))
    for k, v in (arrays or {}).items():
        if v is None:
            parts.pop(k)
        else:
            parts[k] = v
    np.savez(out, **parts)
    return out


def test_good_files_load(tmp_path):
    for e in (image_expl(), text_expl()):
        back = Explanation.load(e.save(tmp_path / "e.npz"))
        assert torch.equal(back.scores, e.scores) and back.prefix == e.prefix and back.tokens == e.tokens


@pytest.mark.parametrize("meta, arrays, words", [
    ({"prefix": -3}, None, "'prefix' must be an integer from 0 to 7"),
    ({"prefix": 500}, None, "'prefix' must be an integer from 0 to 7"),
    ({"prefix": 2}, None, "scores have 6 units, but full_row's 7 tokens less prefix 2 and suffix 0 leave 5"),
    ({"prefix": 0}, None, "leave 7"),
    ({"suffix": -1}, None, "'suffix' must be an integer from 0 to 7"),
    ({"suffix": 2}, None, "suffix 2 leave 4"),
    ({"suffix": True}, None, "'suffix' must be an integer"),
    ({"grid": [3, 3]}, None, "grid 3x3 does not hold the 6 units"),
    ({"grid": [-2, -3]}, None, "grid -2x-3 does not hold"),
    ({"positions": [0]}, None, "'positions' must hold one entry per example (2), got 1 entries"),
    ({"positions": [0, -1]}, None, "'positions' must be non-negative integers"),
    ({"target": [1, 0, 2]}, None, "'target' must hold one entry per example (2), got 3"),
    ({"tokens": [["a"] * 6]}, None, "'tokens' must hold one entry per example (2)"),
    ({"tokens": [["a"], [3]]}, None, "'tokens' must be lists of strings"),
    ({"readout": {"kind": "cls", "positions": [0, 0, 0]}}, None, "'readout positions' must hold one entry"),
    ({"readout": "cls"}, None, "'readout' must be a mapping"),
    (None, {"layers": np.zeros((2, 3, 7), np.float32)}, "layers has shape (2, 3, 7), expected (layers, 2, 7)"),
    (None, {"layers": np.zeros((2, 7), np.float32)}, "layers has shape (2, 7)"),
    (None, {"attention_mask": np.ones((2, 6), np.int64)}, "attention_mask has shape (2, 6), expected (2, 7)"),
    (None, {"readout_weights": np.zeros((3, 7), np.float32)}, "readout_weights has shape (3, 7)"),
    (None, {"scores": np.zeros((2, 6), np.int64)}, "scores must be floating point"),
    ({"dtypes": {"scores": "int8"}}, None, "names 'scores' as 'int8'"),
    ({"dtypes": {"nothing": "bfloat16"}}, None, "names 'nothing'"),
    ({"dtypes": ["bfloat16"]}, None, "'dtypes' must be a mapping"),
])
def test_metadata_that_contradicts_the_arrays_is_refused(tmp_path, meta, arrays, words):
    good = image_expl().save(tmp_path / "good.npz")
    bad = tamper(good, tmp_path / "bad.npz", meta, arrays)
    with pytest.raises(ValueError) as e:
        Explanation.load(bad)
    assert str(bad) in str(e.value) and words in str(e.value), str(e.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_half_precision_round_trip(tmp_path, dtype):
    e = image_expl(dtype)
    path = e.save(tmp_path / "e.npz")
    back = Explanation.load(path)
    for name in ("scores", "full_row", "layers", "readout_weights"):
        a, b = getattr(e, name), getattr(back, name)
        assert b.dtype == dtype and torch.equal(a, b), name
    assert back.extra["heads"].dtype == dtype and torch.equal(back.extra["heads"], e.extra["heads"])
    with np.load(path, allow_pickle=False) as z:
        stored = json.loads(str(z["__meta__"]))["dtypes"]
        want = np.float32 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype
        assert z["scores"].dtype == want
    assert stored == ({k: "bfloat16" for k in ("scores", "full_row", "layers", "readout_weights", "extra__heads")}
                      if dtype == torch.bfloat16 else {})


def test_bfloat16_options_and_targets_save(tmp_path):
    e = image_expl()
    e.options = {"weights": torch.tensor([0.5, 0.25], dtype=torch.bfloat16)}
    back = Explanation.load(e.save(tmp_path / "e.npz"))
    assert back.options == {"weights": [0.5, 0.25]}
