"""attnroll._system: the terminal and machine side of the pure core (progress bar, available memory), and
the public attention_flow wrapper that hands them to core.flow."""

import numpy as np
import pytest

from attnroll import _system as system_mod
from attnroll.core import flow as flow_mod


def test_plain_progress_fallback(capsys):
    bar = system_mod.ProgressBar(4, True)
    bar._kind = "plain"  # what users without tqdm or rich see
    for _ in range(4):
        bar(1)
    bar.close()
    err = capsys.readouterr().err
    assert "4/4" in err and "attention flow" in err


def test_available_memory_is_a_positive_byte_count():
    have = system_mod.available_memory()
    assert have is None or (isinstance(have, int) and have > 0)


def test_the_pure_flow_reports_progress_and_checks_memory_only_through_its_arguments(capsys):
    rng = np.random.default_rng(0)
    a = rng.random((2, 1, 2, 5, 5))
    layers = list(a / a.sum(-1, keepdims=True))
    calls = []
    out = flow_mod.attention_flow(layers, rows=[0, 1], progress=lambda k, total: calls.append((k, total)))
    assert capsys.readouterr().err == ""  # the pure function prints nothing
    assert calls[0] == (0, 10) and sum(k for k, _ in calls) == 10  # 2 rows x 5 inputs
    np.testing.assert_allclose(out, system_mod.attention_flow(layers, rows=[0, 1]))
    with pytest.raises(MemoryError, match="needs about"):
        flow_mod.attention_flow(layers, available_memory=10)
    with pytest.raises(TypeError, match="progress must be None or a callable"):
        flow_mod.attention_flow(layers, progress=True)
