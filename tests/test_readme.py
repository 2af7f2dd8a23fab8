"""README's code blocks marked ``<!-- tested ... -->`` run as they are written: the first one (the core API)
included, which reads a transformers model's attention the way a newcomer would."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
#: The libraries of the integrations' extras: a block that needs a missing one is skipped.
OPTIONAL = {"captum", "inseq", "transformer_lens", "open_clip"}
MARKED = re.compile(r"<!-- tested[^>]*-->\n```python\n(.*?)```", re.DOTALL)


def marked_blocks() -> list[str]:
    return MARKED.findall(README.read_text(encoding="utf-8"))


def test_the_first_python_block_is_marked_tested():
    text = README.read_text(encoding="utf-8")
    first = re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)
    assert marked_blocks() and marked_blocks()[0] == first


@pytest.mark.parametrize("block", marked_blocks(), ids=lambda b: b.splitlines()[0][:40])
def test_marked_readme_blocks_run(block):
    pytest.importorskip("transformers")
    import numpy as np
    import torch

    scope: dict = {}
    try:
        exec(compile(block, str(README), "exec"), scope)  # noqa: S102 - the README's own code
    except ModuleNotFoundError as e:  # an integration's library (its extra) is not installed here
        if (e.name or "").split(".")[0] not in OPTIONAL:
            raise
        pytest.skip(f"{e.name} is not installed (an optional extra)")
    if "attentions" in scope:  # the core API block: the attention is really there, and rollout reads it
        atts, B = scope["attentions"], scope["B"]
        assert len(atts) == 4 and atts[0].shape == (B, 4, 197, 197)
        n = atts[0].shape[-1]
        R = torch.eye(n).expand(B, n, n)
        for a in atts:
            R = (0.5 * a.mean(1) + 0.5 * torch.eye(n)) @ R
        np.testing.assert_allclose(scope["R"], R, atol=1e-5)
        assert tuple(scope["cls"].shape) == (B, 1, n)
