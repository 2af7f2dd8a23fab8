"""Every private part of transformers that attnroll reads or switches, in one place, each behind a shape check.

* the version range the transformers adapter is written for (:data:`TRANSFORMERS_RANGE`);
* the output-recorder declaration of a model class (``_can_record_outputs``, or the registry of newer
  releases, ``transformers.utils.output_capturing._CAN_RECORD_REGISTRY``) and its ``OutputRecorder``
  entries (``target_class``, ``class_name``, ``index``, ``layer_name``): where the attention modules are;
* a config's attention implementation (``_attn_implementation`` / ``_attn_implementation_internal``), read
  and switched to "eager" for a capture and put back exactly;
* the attention-kernel lookup (``AttentionInterface.get_interface`` / ``__getitem__``), wrapped for a
  matrix-free capture and restored; the SDPA kernel (``sdpa_attention_forward``) it recognises.

:func:`surface_problems` says what of this the installed transformers no longer has (checked by
``tests/capture/test_transformers_private.py``). A changed shape met at run time raises naming the version.
"""

from __future__ import annotations

import warnings
from contextlib import ExitStack
from typing import Any, Callable

from torch import nn

from .. import _checks

__all__ = ["TRANSFORMERS_RANGE", "check_transformers_version", "PrivateChanged", "declared_outputs",
           "recorder_specs", "all_configs", "force_eager", "attn_implementation", "wrap_attention_interface",
           "sdpa_kernel", "surface_problems", "LOAD_ONLY_CONFIG_KEYS"]

#: Keys of ``config.to_dict()`` that say how a model was loaded (its folder, the library version, the attention
#: implementation it runs, its dtype), not what it computes: a model's fingerprint leaves them out.
LOAD_ONLY_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_attn_implementation",
                         "_attn_implementation_internal", "torch_dtype", "dtype", "_commit_hash")

#: The transformers major versions the adapter works with: [5, 6). It reads ``_can_record_outputs`` /
#: ``OutputRecorder`` declarations, which every model class has only from 5.0 on, and switches the attention
#: implementation through 5.x's config API. pyproject.toml's ``hf`` / ``text`` extras declare the same range.
TRANSFORMERS_RANGE = ((5, 0), (6, 0))


def check_transformers_version(version: str) -> None:
    """UnsupportedModelError for a transformers version below the range (the adapter cannot find the
    attention there); a RuntimeWarning above it (not tested: it may work)."""
    parts = []
    for p in version.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit()) if p[:1].isdigit() else ""
        parts.append(int(digits) if digits else 0)
    v = tuple((parts + [0, 0])[:2])
    lo, hi = TRANSFORMERS_RANGE
    want = f"transformers>={lo[0]}.{lo[1]},<{hi[0]}"
    if v < lo:
        raise _checks.UnsupportedModelError(
            f"attnroll's transformers adapter needs {want}; transformers {version} is installed "
            "(its model classes do not declare their attention outputs): pip install 'attnroll[hf]'"
        )
    if v >= hi:
        warnings.warn(f"attnroll's transformers adapter is tested with {want}; transformers {version} is newer "
                      "and may have moved where attention lives", RuntimeWarning, stacklevel=3)


# ------------------------------------------------------------------------------- output recorders
class PrivateChanged(Exception):
    """transformers' private output-recorder declaration has a shape this attnroll does not know."""


def declared_outputs(pm: nn.Module) -> dict:
    """The class's output-recorder declaration (transformers 5.x, private): the registry of newer
    releases, else the class attribute."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

        raw = _CAN_RECORD_REGISTRY.get(pm)
    except (ImportError, AttributeError, TypeError):
        raw = None
    raw = raw or getattr(pm, "_can_record_outputs", None) or {}
    if not isinstance(raw, dict):
        raise PrivateChanged(f"_can_record_outputs is a {type(raw).__name__}, not a dict")
    return raw


def recorder_specs(raw: dict) -> list[tuple[str, type | None, str | None, int, str | None]]:
    """(key, target class, class-name suffix, output index, layer name) for the attention outputs of a
    declaration (:func:`declared_outputs`). Raises PrivateChanged when its shape is unknown."""
    out = []
    for key in ("attentions", "cross_attentions"):
        if key not in raw:
            continue
        val = raw[key]
        for spec in val if isinstance(val, list) else [val]:
            if hasattr(spec, "target_class"):  # transformers' OutputRecorder
                try:
                    out.append((key, spec.target_class, spec.class_name, int(spec.index), spec.layer_name))
                except (AttributeError, TypeError, ValueError) as e:
                    raise PrivateChanged(f"OutputRecorder fields changed ({e})") from None
            elif isinstance(spec, str):
                out.append((key, None, spec, 1, None))
            elif isinstance(spec, type):
                out.append((key, spec, None, 1, None))
            else:
                raise PrivateChanged(f"unknown recorder entry {type(spec).__name__}")
    return out


# ------------------------------------------------------------------------------- attention implementation
def all_configs(model: nn.Module) -> list[Any]:
    """Every distinct config object reachable from the model's submodules and their sub-configs."""
    from transformers import PretrainedConfig

    seen: dict[int, Any] = {}
    todo = [m.config for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)]
    while todo:
        c = todo.pop()
        if id(c) in seen:
            continue
        seen[id(c)] = c
        for key in getattr(c, "sub_configs", None) or {}:
            sub = getattr(c, key, None)
            if isinstance(sub, PretrainedConfig):
                todo.append(sub)
    return list(seen.values())


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a config asks for ("eager", "sdpa", ...), None when it says none."""
    return getattr(config, "_attn_implementation", None)


def force_eager(stack: ExitStack, config: Any) -> None:
    """Set one config's attention implementation to "eager" and register restoring its exact value.

    The internal attribute is written, not the ``_attn_implementation`` setter, because the setter
    recurses into sub-configs; each sub-config is handled (and restored) on its own."""
    attr = (
        "_attn_implementation_internal"
        if "_attn_implementation_internal" in config.__dict__
        else "_attn_implementation"
    )
    missing = object()
    old = config.__dict__.get(attr, missing)

    def restore() -> None:
        if old is missing:
            config.__dict__.pop(attr, None)
        else:
            config.__dict__[attr] = old

    stack.callback(restore)
    config.__dict__[attr] = "eager"


# ------------------------------------------------------------------------------- the kernel lookup
def wrap_attention_interface(stack: ExitStack, wrap: Callable[[Callable, str], Callable]) -> None:
    """Until ``stack`` closes, every kernel transformers' attention modules look up
    (``AttentionInterface.get_interface(impl, default)``, and ``ALL_ATTENTION_FUNCTIONS[impl]``, which a few
    modules index directly) is handed out as ``wrap(kernel, impl)``. Both methods are restored exactly on
    exit (an inherited ``__getitem__`` is inherited again)."""
    from transformers.modeling_utils import AttentionInterface

    original = AttentionInterface.__dict__["get_interface"]
    own_item = AttentionInterface.__dict__.get("__getitem__")  # None: inherited (GeneralInterface's)
    original_item = AttentionInterface.__getitem__

    def get_interface(iface: Any, attn_implementation: str, default: Callable) -> Callable:
        return wrap(original(iface, attn_implementation, default), attn_implementation)

    def getitem(iface: Any, key: str) -> Callable:
        return wrap(original_item(iface, key), key)

    def restore() -> None:
        AttentionInterface.get_interface = original
        if own_item is None:
            if "__getitem__" in AttentionInterface.__dict__:
                del AttentionInterface.__getitem__
        else:
            AttentionInterface.__getitem__ = own_item

    stack.callback(restore)
    AttentionInterface.get_interface = get_interface
    AttentionInterface.__getitem__ = getitem


def sdpa_kernel() -> Callable:
    """transformers' own SDPA attention kernel (``sdpa_attention_forward``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


# ------------------------------------------------------------------------------- the surface, checked
def surface_problems() -> list[str]:
    """What of the private surface above the installed transformers lacks ([] when everything is found):
    checked on a tiny BERT built from its config (no weights are read)."""
    import transformers as T

    problems = []
    try:
        check_transformers_version(T.__version__)
    except _checks.UnsupportedModelError as e:
        problems.append(str(e))
    model = T.BertModel(T.BertConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2,
                                     intermediate_size=8, vocab_size=10))
    try:
        specs = [s for m in model.modules() if isinstance(m, T.PreTrainedModel)
                 for s in recorder_specs(declared_outputs(m))]
        if not any(key == "attentions" for key, *_ in specs):
            problems.append("BertModel declares no 'attentions' output recorder")
    except PrivateChanged as e:
        problems.append(f"output recorders: {e}")
    config = model.config
    if attn_implementation(config) is None:
        problems.append("a config has no _attn_implementation")
    if not hasattr(config, "sub_configs"):
        problems.append("PretrainedConfig has no sub_configs")
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

        if "get_interface" not in AttentionInterface.__dict__ or not callable(ALL_ATTENTION_FUNCTIONS["sdpa"]):
            problems.append("AttentionInterface.get_interface / __getitem__ changed")
        sdpa_kernel()
    except (ImportError, KeyError, AttributeError) as e:
        problems.append(f"attention interface: {type(e).__name__}: {e}")
    return problems
