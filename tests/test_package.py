"""The package's own contract: importing attnroll pulls in no optional dependency."""

import subprocess
import sys

import pytest

OPTIONAL = ("transformers", "timm", "matplotlib", "click", "captum", "rich", "PIL", "networkx", "safetensors", "numba")


@pytest.mark.slow
def test_import_loads_no_optional_dependency():
    code = (
        "import sys, attnroll; attnroll.rollout; attnroll.attention_flow; attnroll.explain; attnroll.capture; "
        f"print(','.join(m for m in {OPTIONAL!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"optional modules imported by 'import attnroll': {out.stdout.strip()}"


def test_public_api_is_exported():
    import attnroll

    for name in ("rollout", "per_head_rollout", "attention_flow", "fuse_heads", "add_residual", "sparsify",
                 "capture", "AttentionRecord", "explain", "Explainer", "Explanation", "methods",
                 "UnsupportedModelError"):
        assert hasattr(attnroll, name) and name in attnroll.__all__, name
