"""Imports every method file so that each registers itself (order = the order of ``methods()``)."""

from . import raw, rollout, per_head_rollout, flow, grad_rollout, gae, attn_gradcam  # noqa: F401
from . import encdec, clip, captum_baselines, random  # noqa: F401
from . import norm, norm_rollout, globenc, alti, decompx, value_zeroing  # noqa: F401
