"""Hugging Face transformers adapter.

Where the attention is: transformers (5.x) declares, per model class, which module's output holds the
attention probabilities (``_can_record_outputs``: ``"attentions"`` and ``"cross_attentions"``, a module
class plus the index into its output tuple). We read that declaration the way transformers itself does
(each nested ``PreTrainedModel`` uses its own) and hook those modules directly, instead of asking for
``output_attentions=True``: the hook can fuse heads before anything is kept, and nothing is stored twice.

How it is materialised: SDPA and flash attention never form the probability matrix, so for the duration of
the capture every config in the model (sub-configs included) is switched to ``"eager"`` and put back
exactly afterwards.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from .. import _checks
from . import diffllama
from .hf_public import accepts_output_attentions, ask_for_attentions, eager_forwards, output_streams, validate_layers
from .hf_vision import embeddings_of, input_size, mae_restore, patch_layout
from .hooks import Adapter, Recorder, Site, make_sites, stream_names, supported_families
from .hybrids import Wiring, mixer_matrix, mixer_reading
from .mixers import ROWS_MIXERS, WEIGHTED, WIRED, composable_mixers
from .record import AttentionRecord, ModelFacts, config_token_id, config_token_ids, resolve_readout
from .st_pooling import pooling_of_folder
from .transformers_private import (
    TRANSFORMERS_RANGE,  # noqa: F401  (importable from here, as before)
    PrivateChanged,
    all_configs,
    check_transformers_version,
    declared_outputs,
    force_eager,
    recorder_specs,
)

#: Text towers that pool their end-of-text token (the first EOS; the argmax id for the original configs).
_EOT_POOLING = ("clip", "clip_text_model", "owlvit", "owlvit_text_model", "owlv2", "owlv2_text_model", "x_clip",
                "groupvit", "clipseg", "metaclip_2", "metaclip_2_text_model", "aimv2", "aimv2_text_model")
#: Of those, the towers that pool the largest token id (the end-of-text token of their vocabulary) whatever
#: their eos id, and those that pool the first eos token whatever it is (no argmax rule for eos id 2).
_ARGMAX_POOLING = ("owlvit", "owlvit_text_model", "owlv2", "owlv2_text_model")
_FIRST_EOS_POOLING = ("metaclip_2", "metaclip_2_text_model", "aimv2", "aimv2_text_model")
#: Text towers that pool the last position (SigLIP: inputs padded to max_length).
_LAST_POSITION = ("siglip", "siglip_text_model", "siglip2", "siglip2_text_model")
#: Image models whose pooler means the patch tokens when ``config.use_mean_pooling``.
_MEAN_POOLING_FLAG = ("beit", "data2vec-vision", "videomae")
#: Speech encoders: their classification heads mean-pool the frames.
_AUDIO = ("wav2vec2", "hubert", "wavlm", "data2vec-audio", "sew", "sew-d", "unispeech", "unispeech-sat",
          "wav2vec2-conformer", "wav2vec2-bert")

#: Windowed models: attention is computed inside local (shifted) windows, so no (n x n) token matrix exists;
#: those of ``SWIN_TYPES`` are captured by the Swin adapter (capture/swin.py), the rest refused.
_WINDOWED = ("swin", "swinv2", "donut-swin", "maskformer-swin", "swin2sr")
SWIN_TYPES = ("swin", "swinv2", "donut-swin", "maskformer-swin")


def is_hf_model(model: nn.Module) -> bool:
    """True for a transformers ``PreTrainedModel`` (checked without importing transformers)."""
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


#: The class's output-recorder declaration (transformers_private.declared_outputs), looked up here at call time.
_declared = declared_outputs


def _specs(pm: nn.Module) -> list[tuple[str, type | None, str | None, int, str | None]]:
    """(key, target class, class-name suffix, output index, layer name) for the attention outputs a
    transformers model class declares. Raises PrivateChanged when the declaration's shape is unknown."""
    return recorder_specs(_declared(pm))


class HFAdapter(Adapter):
    family = "hf"
    #: True for the VLM adapter (capture/vlm.py), which splits the streams; the plain adapter refuses VLMs.
    composes_vlm = False

    def __init__(self, model: nn.Module):
        super().__init__(model)
        import transformers
        from transformers import PreTrainedModel

        check_transformers_version(transformers.__version__)

        # Lookups that depend only on the model's structure (the embeddings module of a stream); the
        # kernel adapter's per-structure template shares this dict with every copy it hands out.
        self.memo: dict[Any, Any] = {}
        config = model.config
        self.model_type = getattr(config, "model_type", "")
        self.family = f"hf:{self.model_type}"
        _refuse_windowed(model, self.model_type)
        _refuse_unreadable(model, self.model_type)
        vlm_token = next((k for k in ("image_token_index", "image_token_id") if hasattr(config, k)), None)
        if vlm_token is not None and not self.composes_vlm and getattr(config, "vision_config", None) is not None and (
            getattr(config, "text_config", None) is not None
        ):
            raise _checks.UnsupportedModelError(
                f"{type(model).__name__} ({self.model_type}) is a vision-language model: its image patches enter "
                "the language model as tokens (config." + vlm_token + "), so the vision tower and the language "
                "model would be merged into one stream and the image tokens could not be mapped back to the patch "
                "grid. attnroll composes the VLM families of capture/vlm.py and capture/vlm_maps.py only; explain the "
                "vision tower "
                "(model.vision_tower / model.model.vision_tower) or the language model on its own. "
                f"Supported: {supported_families()}"
            )
        found: list[tuple[str, nn.Module, str, int]] = []

        def walk(mod: nn.Module, name: str, specs: list) -> None:
            for cname, child in mod.named_children():
                full = f"{name}.{cname}" if name else cname
                walk(child, full, _specs(child) if isinstance(child, PreTrainedModel) else specs)
            for key, cls, class_name, index, layer_name in specs:
                hit = (cls is not None and isinstance(mod, cls)) or (
                    class_name is not None and name.endswith(class_name)
                )
                if hit and layer_name is not None:
                    hit = "." + layer_name.strip(".") + "." in "." + name + "."
                if hit:
                    found.append((name, mod, key, index))
                    break

        try:
            walk(model, "", _specs(model))
        except PrivateChanged as e:
            import transformers

            # Models that declare recorders also route output_attentions=True through them (transformers
            # installs its own hooks for good), so the public path is no way out here: say what changed.
            raise _checks.UnsupportedModelError(
                f"transformers {transformers.__version__} changed its private output-recorder declaration ({e}), "
                f"which attnroll reads to find the attention modules of {type(model).__name__}; this attnroll "
                "knows the transformers 5.x shape. Install a transformers 5.x release, or pass modules=/to_probs="
            ) from None
        order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
        found = self._with_mixers(found)
        found.sort(key=lambda f: order.get(id(f[1]), -1))
        self.index = {id(m): idx for _, m, _, idx in found}
        selfs = [f for f in found if f[2] == "attentions"]
        names = stream_names([f[0] for f in selfs])
        stream_of = {id(f[1]): s for f, s in zip(selfs, names)}
        entries = [(n, m, stream_of.get(id(m), "cross")) for n, m, key, _ in found]
        self._sites = make_sites(entries)
        if not self._sites:
            if not accepts_output_attentions(model):
                raise _checks.UnsupportedModelError(
                    f"{type(model).__name__} neither declares which of its modules output attention weights "
                    "(transformers' output recorders) nor takes output_attentions=, so attnroll cannot find them. "
                    f"Supported: {supported_families()}"
                )
            # The public path: the model's own output_attentions=True on the eager path.
            self.from_outputs = True
            self.family = f"hf:{self.model_type} (output_attentions)"

    def _with_mixers(self, found: list) -> list:
        """The attention sites ``found`` with the composed token mixers added as sites of their own, less the
        modules that are part of another site's layer (capture/hybrids.py Wiring: parallel branches, shared
        blocks)."""
        self.wiring = Wiring(self.model)
        found = [f for f in found if id(f[1]) not in self.wiring.not_sites]
        mixers = [(name, m) for name, m in composable_mixers(self.model) if id(m) not in self.wiring.not_sites]
        self.mixer_ids = {id(m) for _, m in mixers}
        # a hybrid's mixer layers repeat their one fused matrix on every head of its attention layers (so that the
        # stream's layers have one shape: head fusions leave it unchanged)
        heads = getattr(self.model.config, "num_attention_heads", 1)
        self.mixer_heads = heads if (found or self.wiring.shared) and self.mixer_ids and isinstance(
            heads, int) and heads > 0 else 1
        return found + [(name, m, "attentions", 0) for name, m in mixers]

    def sites(self) -> list[Site]:
        return self._sites

    def install(self, stack: ExitStack, recorder: Recorder, sites: list[Site]) -> None:
        for config in all_configs(self.model):
            force_eager(stack, config)
        if self.from_outputs:
            eager_forwards(stack, self.model)
            ask_for_attentions(stack, self.model)
        diffllama.install(stack, self.model)  # differential attention: its signed matrix is what the record holds
        self.install_pool_hooks(stack)
        super().install(stack, recorder, [s for s in sites if id(s.module) not in self.mixer_ids])
        self.mixer_weighted: dict[tuple[str, int], Any] = {}
        self.mixer_layers: set[tuple[str, int]] = set()
        for site in sites:
            if id(site.module) in self.mixer_ids:  # a composed token mixer: its matrix, from its inputs and output
                handle = site.module.register_forward_hook(
                    lambda m, a, k, o, site=site: self._store_mixer(recorder, site, m, a, k, o), with_kwargs=True)
                stack.callback(handle.remove)
        self.wiring.keep_grad = recorder.keep_grad
        self.wiring.install(lambda m, fn, pre=False: stack.callback(
            (m.register_forward_pre_hook if pre else m.register_forward_hook)(fn, with_kwargs=True).remove))

    def _store_mixer(self, recorder: Recorder, site: Site, m: nn.Module, a: tuple, k: dict, o: Any) -> None:
        """A composed mixer's fused matrix, repeated on the stream's heads; with gradients kept (and a mixer
        whose gradient-weighted matrix attnroll computes), also its output and weighting
        (``record.extra["mixer_weighted"]``, read by ``Context.grad_record``; a shared-attention layer's weighs its
        mixer's output and the shared attention's probabilities: capture/hybrids.py Wiring)."""
        self.mixer_layers.add((site.stream, site.layer))
        if recorder.keep_grad and type(m).__name__ in WEIGHTED:
            fused, self.mixer_weighted[(site.stream, site.layer)] = self.wiring.mixer_weighted(
                m, *mixer_reading(m, a, k, o))
            fused.requires_grad_(True)  # a leaf of the record's graph: the gradient is taken at the mixer's output
        else:
            fused = self.wiring.mixer(m, mixer_matrix(m, a, k, o))
        recorder.store(site, fused.expand(-1, self.mixer_heads, -1, -1))

    def install_pool_hooks(self, stack: ExitStack, heads: list[tuple[str, nn.Module]] | None = None) -> None:
        """Hook attention-pooling heads (SigLIP's MAP head) for their probe's attention, the readout;
        ``heads``: ``pool_heads(model)`` when the caller has them already."""
        self.pool_attn: dict[str, torch.Tensor] = {}
        for where, head in pool_heads(self.model) if heads is None else heads:
            handle = head.register_forward_hook(self._pool_hook(where))
            stack.callback(handle.remove)

    def output_streams(self, output: Any) -> dict[str, list[Any]]:
        return output_streams(self.model, output)

    def _pool_hook(self, stream: str):
        """An attention-pooling head (SigLIP's MAP head: a learned probe attending over the tokens): its own
        attention weights, mean over heads, (B, n), become the stream's readout."""

        def hook(head: nn.Module, args: tuple, output: Any) -> None:
            x = args[0]
            probe = head.probe.expand(x.shape[0], -1, -1)
            with torch.no_grad():
                _, w = head.attention(probe, x, x, need_weights=True, average_attn_weights=True)
            self.pool_attn[stream] = w[:, 0].detach().float().cpu()

        return hook

    def extract(self, site: Site, args: tuple, output: Any) -> Any:
        if isinstance(output, (tuple, list)):
            idx = self.index[id(site.module)]
            probs = output[idx] if -len(output) <= idx < len(output) else None
            wiring = getattr(self, "wiring", None)
            if not wiring:
                return probs
            probs = wiring.attention(site.module, probs, output)
            if id(site.module) in wiring.weighted:  # a parallel layer's gradient-weighted entry (gradients kept)
                self.mixer_weighted[(site.stream, site.layer)] = wiring.weighted.pop(id(site.module))
            return probs
        return output

    def facts(self) -> ModelFacts:
        return hf_facts(self.model, self.family)

    main_inputs = ("input_ids", "inputs_embeds", "pixel_values", "input_features", "input_values")

    @property
    def inputs_example(self) -> str:  # type: ignore[override]
        name = getattr(self.model, "main_input_name", "input_ids")
        if name == "pixel_values":
            return (
                "For example inputs = processor(images, return_tensors='pt') or {'pixel_values': (B, 3, H, W) tensor}."
            )
        return (
            f"For example inputs = tokenizer(texts, return_tensors='pt') or {{'{name}': (B, n) tensor of token ids}} "
            "(a plain list of ids is not enough: wrap it as torch.tensor([ids]))."
        )

    def input_hint(self, inputs: Any) -> str:
        keys = set(inputs) if isinstance(inputs, dict) or hasattr(inputs, "keys") else set()
        if getattr(self.model.config, "is_encoder_decoder", False) and not keys & {
            "decoder_input_ids",
            "decoder_inputs_embeds",
            "labels",
        }:
            return (
                f"{type(self.model).__name__} is an encoder-decoder: pass decoder_input_ids (the target tokens "
                "so far) so that its decoder runs."
            )
        return ""

    # ------------------------------------------------------------------------------------- readout
    def readout_spec(self, stream: str, record: AttentionRecord, info: Any, inputs: dict[str, Any]) -> tuple[Any, str]:
        cfg, mt = self.model.config, self.model_type
        pooled = getattr(self, "pool_attn", {}).get(stream)
        if pooled is not None:
            return ("attention_pool", pooled), f"{mt}'s attention-pooling head: its probe's attention over the tokens"
        if record.extra.get(f"{stream}_eot") is not None:
            return "eot", f"{mt}'s text tower pools its end-of-text token"
        if info.kind == "text" and mt in _LAST_POSITION:
            return -1, f"{mt}'s text tower pools the last position"
        if info.kind == "text" and stream == "self":
            pool = pooling_of_folder(getattr(cfg, "_name_or_path", None))
            if pool is not None:
                return pool
        if hasattr(self.model, "cls_classifier") and hasattr(self.model, "distillation_classifier"):
            w = torch.zeros(record.streams[stream][0].shape[-1])
            w[:2] = 0.5
            return w, "DeiT with teacher: its logits average the CLS and distillation tokens' heads"
        if (mt in ("dinov2", "dinov2_with_registers") and stream == "self"
                and getattr(getattr(self.model, "classifier", None), "in_features", None) == 2 * cfg.hidden_size):
            w = torch.zeros(n := record.streams[stream][0].shape[-1])
            w[0] = 0.5
            w[info.prefix:] = 0.5 / max(1, n - info.prefix)
            return w, (f"{mt}'s classifier reads [CLS ; mean of the patch rows]: half the weight on CLS, half spread "
                       "over the patches")
        if mt == "audio-spectrogram-transformer" and stream == "self":
            w = torch.zeros(n := record.streams[stream][0].shape[-1])
            w[:2] = 0.5
            return w, "AST's pooler averages the CLS and distillation tokens"
        if info.suffix and stream == "self":  # YOLOS: each detection token predicts one object
            w = torch.zeros(n := record.streams[stream][0].shape[-1])
            w[n - info.suffix:] = 1.0
            return w, "the detection tokens (one object each; pick one with position=)"
        if mt in _MEAN_POOLING_FLAG and getattr(cfg, "use_mean_pooling", False) and stream in ("self", "vision"):
            return "mean", f"{mt} config.use_mean_pooling: the pooler means the patch tokens"
        if mt in _AUDIO:
            return "mean", f"{mt} classification heads mean-pool the frames"
        if info.causal:
            return "last", "causal attention: the last real token predicts"
        if info.kind == "image" and info.prefix == 0:
            return "mean", "no class token: the mean of the patch rows (what its classification heads pool)"
        return "cls", "the first token (CLS), which the model's pooler / classifier reads"

    # ------------------------------------------------------------------------------------- metadata
    def metadata(self, record: AttentionRecord, inputs: dict[str, Any]) -> None:
        if getattr(self, "mixer_weighted", None):
            record.extra["mixer_weighted"], self.mixer_weighted = self.mixer_weighted, {}
        if getattr(self, "mixer_layers", None):  # which layers are composed mixers (mixers="attention_only" drops them)
            record.extra["mixer_layers"], self.mixer_layers = sorted(self.mixer_layers), set()
        if getattr(self.model.config, "attention_type", None) == "block_sparse":
            self._refuse_block_sparse(record)
        for stream, layers in record.streams.items():
            validate_layers(type(self.model).__name__, stream, layers, signed=self.model_type in _SIGNED)
        if not self.composes_vlm:
            _check_batch(self.model, record, inputs)
        ids = inputs.get("input_ids")
        text_stream = "text" if "text" in record.streams else "self"
        if self.model_type in _EOT_POOLING and isinstance(ids, torch.Tensor) and text_stream in record.streams:
            record.extra[f"{text_stream}_eot"] = _eot_positions(self.model.config, ids, self.model_type)
        mask = inputs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            record.attention_mask = mask.detach()
        dmask = inputs.get("decoder_attention_mask")
        if isinstance(dmask, torch.Tensor):
            record.extra["decoder_attention_mask"] = dmask.detach()
        record.prefix = 0 if ids is not None else None
        for stream in ("self", "vision", "encoder"):
            if stream in record.streams and input_size(self.model_type, inputs) is not None:
                self._layout(record, stream, inputs)

    def _refuse_block_sparse(self, record: AttentionRecord) -> None:
        """BigBird's block-sparse path returns a dense matrix rebuilt from its blocks, whose rows do not sum
        to 1 and which its output is not computed from: refuse rather than roll it out."""
        for layers in record.streams.values():
            t = layers[0].detach()
            sums = t.sum(dim=-1)
            if not bool(((sums - 1).abs() < 1e-3).all()):
                raise _checks.UnsupportedModelError(
                    f"{type(self.model).__name__} ran its block-sparse attention (config.attention_type="
                    "'block_sparse'): the matrix it returns is rebuilt from blocks (rows sum to "
                    f"{float(sums.min()):.3g}..{float(sums.max()):.3g}) and is not the tensor its output uses. Set "
                    "model.config.attention_type = 'original_full' (or load with attention_type='original_full')."
                )

    def _layout(self, record: AttentionRecord, stream: str, inputs: dict[str, Any]) -> None:
        """Prefix, suffix and grid of a vision stream from the model's embeddings (see hf_vision)."""
        if stream == "encoder" and inputs.get("pixel_values") is None and inputs.get("input_values") is None:
            return
        n = record.streams[stream][0].shape[-1]
        if ("embeddings", stream) not in self.memo:
            self.memo[("embeddings", stream)] = embeddings_of(self.model, stream)
        lay = patch_layout(self.model, stream, self.model_type, inputs, n, self.memo[("embeddings", stream)])
        ids_restore = getattr(record.outputs, "ids_restore", None)
        if lay["grid"] is not None and self.model_type == "vit_mae" and isinstance(ids_restore, torch.Tensor):
            if record.streams[stream][0].is_meta:  # the matrix-free capture: its kernels saw the shuffled tokens
                raise _checks.UnsupportedModelError(_MAE_SHUFFLE + "; the matrix-free route recomputes the "
                                                    "shuffled order, so use attention='dense'")
            if not bool((ids_restore.cpu() == torch.arange(ids_restore.shape[-1])).all()):
                _unshuffle(record, stream, ids_restore, lay["prefix"])
        record.extra[f"{stream}_layout"] = lay
        if stream in ("self", "vision"):
            record.prefix, record.grid = lay["prefix"], lay["grid"]
            record.extra["grid_reason"] = lay["reason"]

    def stream_infos(self, record: AttentionRecord, inputs: dict[str, Any]) -> dict[str, Any]:
        infos = super().stream_infos(record, inputs)
        self._declared_causal(record, inputs, infos)
        if self.model_type in _SIGNED:
            _mark_signed(record, infos)
        for s, info in infos.items():
            lay = record.extra.get(f"{s}_layout")
            if lay is not None:
                info.kind, info.prefix, info.suffix, info.grid = "image", lay["prefix"], lay["suffix"], lay["grid"]
                info.grid_reason = lay["reason"]
                info.units_reason = lay.get("units_reason", "")
                # The readout, now that prefix and suffix are known (the base left it: readout_after_layout).
                spec, source = self.readout_spec(s, record, info, inputs)
                B, n = record.streams[s][0].shape[0], record.streams[s][0].shape[-1]
                info.readout = None if spec is None else resolve_readout(
                    spec, batch=B, n=n, mask=info.mask, prefix=info.prefix, suffix=info.suffix, source=source)
                if spec is None:
                    info.readout_reason = source
        return infos

    def readout_after_layout(self, stream: str, record: AttentionRecord) -> bool:
        return record.extra.get(f"{stream}_layout") is not None

    def _declared_causal(self, record: AttentionRecord, inputs: dict[str, Any], infos: dict[str, Any]) -> None:
        """A stream whose attention modules declare themselves causal (``is_causal``) is causal even where its
        matrices do not show it (TimesFM: fully padded query rows attend everywhere; its config says nothing of
        a decoder): its readout is then the last real position, as the model's own prediction reads."""
        for s, info in infos.items():
            if info.causal or info.kind == "image" or s == "cross" or record.extra.get(f"{s}_layout") is not None:
                continue
            first = next((site.module for site in self.sites() if site.stream == s), None)
            if first is not None and any(getattr(m, "is_causal", None) is True for m in first.modules()):
                self.mark_causal(record, inputs, s, info)

    def mark_causal(self, record: AttentionRecord, inputs: dict[str, Any], stream: str, info: Any) -> None:
        """Make ``stream`` causal and its readout the one of a causal stream (``readout_spec``)."""
        info.causal = True
        spec, source = self.readout_spec(stream, record, info, inputs)
        if spec is not None and info.readout is not None:
            B, n = record.stream_shape(stream)[0], record.stream_shape(stream)[-1]
            info.readout = resolve_readout(spec, batch=B, n=n, mask=info.mask, prefix=info.prefix, suffix=info.suffix,
                                           source=source, eot=record.extra.get(f"{stream}_eot"))


def pool_heads(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(stream, module) of every attention-pooling head (a learned ``probe`` and an nn.MultiheadAttention
    ``attention``: SigLIP's MAP head) in ``model``."""
    out = []
    for name, head in model.named_modules():
        if isinstance(getattr(head, "attention", None), nn.MultiheadAttention) and isinstance(
            getattr(head, "probe", None), torch.Tensor
        ):
            out.append(("vision" if "vision" in name.split(".")[0] or name.startswith("vision") else "self", head))
    return out


def _refuse_windowed(model: nn.Module, model_type: str) -> None:
    """Windowed models are not this adapter's: Swin types are captured by capture/swin.py (``capture``
    dispatches them there; only the matrix-free kernel route builds this adapter for them), the rest refused."""
    if model_type in SWIN_TYPES:
        raise _checks.UnsupportedModelError(
            f"{type(model).__name__} ({model_type}) attends inside shifted windows: attnroll captures its window "
            "attention densely and scatters it into each stage's matrix (capture/swin.py), but the matrix-free "
            "route (attention='recompute') recomputes one global attention per layer from its kernel's queries "
            "and keys, which windows do not have. Use attention='dense'."
        )
    if model_type in _WINDOWED or any("Swin" in type(m).__name__ for m in model.modules()):
        raise _checks.UnsupportedModelError(
            f"{type(model).__name__} ({model_type}) computes attention inside local, shifted windows of "
            "patches that merge between stages, so there is no global token-to-token attention matrix to "
            "roll out; attnroll refuses rather than invent one. Use a global-attention model or "
            f"modules=/to_probs= if you have your own composition. Supported: {supported_families()}"
        )


#: Model types whose attention modules return softmax matrices that do not describe how the model mixes its
#: tokens, or whose sequence has no layout attnroll can name: model type -> the obstacle.
_UNREADABLE = {
    "vilt": "its one sequence is the text tokens, then an image CLS token, then image patches that its embeddings "
            "draw in a random order (torch.multinomial patch sampling, config.max_image_length) on every forward: "
            "no patch grid and no fixed token order to label the map with",
}


def _unshuffle(record: AttentionRecord, stream: str, ids_restore: torch.Tensor, prefix: int) -> None:
    """Put ViTMAE's shuffled patches of ``stream`` back in patch order (``mae_restore``); with gradients each
    layer is differentiated through the model's own shuffled tensor (``extra["native"]``), its gradient put
    in patch order the same way."""
    layers = record.streams[stream]
    record.streams[stream] = mae_restore([t.detach() for t in layers] if record.keep_grad else layers,
                                         ids_restore, prefix)
    if record.keep_grad:
        native = record.extra.setdefault("native", {})
        for i, t in enumerate(layers):
            native[(stream, i)] = (t, lambda g, ids=ids_restore, p=prefix: mae_restore([g], ids, p)[0])


_MAE_SHUFFLE = ("ViTMAE shuffles its patches on every forward (random noise; the dense capture puts them back in "
                "patch order with the model's own ids_restore)")


#: Model types whose recorded layers are signed matrices (not probabilities) that multiply the values.
_SIGNED = ("diffllama",)


def _mark_signed(record: AttentionRecord, infos: dict[str, Any]) -> None:
    """Every layer of a differential-attention stream is listed as non-stochastic, with the measured reason."""
    for s, info in infos.items():
        layers = [t.detach() for t in record.streams[s] if not t.is_meta]
        if not layers:
            continue
        sums = torch.stack([t.sum(-1).amin() for t in layers] + [t.sum(-1).amax() for t in layers])
        low = min(float(t.amin()) for t in layers)
        info.nonstochastic = tuple(range(len(record.streams[s])))
        info.stochastic_reason = (f"{diffllama.STOCHASTIC_REASON}: rows sum to {float(sums.min()):.3g}.."
                                  f"{float(sums.max()):.3g} (1 − λ), entries down to {low:.3g}")


def _refuse_unreadable(model: nn.Module, model_type: str) -> None:
    """Refuse a model type of ``_UNREADABLE`` with its obstacle, rather than return a wrong map."""
    why = _UNREADABLE.get(model_type)
    if why is not None:
        raise _checks.UnsupportedModelError(
            f"{type(model).__name__} ({model_type}): {why}; attnroll refuses rather than return a map that "
            f"misreads it. Supported: {supported_families()}"
        )


def _check_batch(model: nn.Module, record: AttentionRecord, inputs: dict[str, Any]) -> None:
    """Each stream's batch axis must be its input's: attention run on windows or frames (one per row of the
    batch axis: TimeSformer; each channel of a time series: PatchTST) or on several images packed into one
    sequence (Pixtral), read as if each row were an input, would be a wrong map."""
    for stream, layers in record.streams.items():
        key = "pixel_values" if stream in ("self", "vision", "encoder") else "input_ids"
        x = inputs.get(key)
        for other in ("input_ids", getattr(model, "main_input_name", None)) if stream == "self" else ():
            x = inputs.get(other) if x is None and other else x
        if not isinstance(x, torch.Tensor) or x.ndim < 2 or stream in ("decoder", "cross"):
            continue
        batches = sorted({int(t.shape[0]) for t in layers})
        if batches != [int(x.shape[0])]:
            raise _checks.UnsupportedModelError(
                f"{type(model).__name__}: its {stream!r} attention runs on {batches} rows of the batch axis for "
                f"{int(x.shape[0])} inputs (windows, frames or channels as rows of the batch axis, or several "
                "inputs packed into one sequence), so no layer is one token-to-token matrix per input; attnroll "
                "refuses rather than read a row of the batch axis as an input."
            )


#: Model types whose methods need the dense route, with why.
_DENSE_ONLY = {
    "vit_mae": _MAE_SHUFFLE,
    "diffllama": ("differential attention: its signed matrix softmax₁ − λ·softmax₂ is formed on the dense route "
                  "(capture/diffllama.py); the matrix-free route recomputes single softmax maps from the kernels"),
}


def hf_facts(model: nn.Module, family: str = "") -> ModelFacts:
    """What evaluation and gradient baselines need from a transformers model, without a forward pass."""
    config = model.config
    text_cfg = getattr(config, "text_config", None) or config
    try:
        emb = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        emb = None
    ids, pad = config_token_ids(text_cfg)
    similarity, stream_inputs = None, {}
    if hasattr(model, "get_image_features") and hasattr(model, "get_text_features"):
        similarity = lambda outputs: outputs.logits_per_image  # noqa: E731  (dual towers: (images, texts))
        # Each tower's input: the first argument of the model's own feature function for it.
        stream_inputs = {s: first_argument(getattr(model, f"get_{k}_features")) for s, k in (("vision", "image"),
                                                                                            ("text", "text"))}
    mixed = [type(m).__name__ for _, m in composable_mixers(model)
             if type(m).__name__ not in ROWS_MIXERS + WIRED][:1]  # WIRED: capture/hybrids.py RowsWiring
    return ModelFacts(
        dense_only=_DENSE_ONLY.get(getattr(config, "model_type", ""), "") or (
            f"its {mixed[0]} layers are composed as dense matrices (the matrix-free route recomputes softmax "
            "attention from its kernel's queries and keys)" if mixed else ""),
        family=family or f"hf:{getattr(config, 'model_type', '')}",
        input_key=getattr(model, "main_input_name", None),
        keyword_call=True,
        embedding=emb if isinstance(emb, nn.Module) else None,
        special_token_ids=ids,
        pad_token_id=pad,
        eos_token_id=config_token_id(text_cfg, "eos_token_id"),
        similarity=similarity,
        stream_inputs={s: k for s, k in stream_inputs.items() if k},
        encoder_decoder=bool(getattr(config, "is_encoder_decoder", False)),
    )


def first_argument(fn: Any) -> str | None:
    """The name of a bound method's first parameter, or None when its signature cannot be read."""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params[0] if params else None


def _eot_positions(config: Any, ids: torch.Tensor, model_type: str = "") -> list[int]:
    """The token a CLIP-style text tower pools: the argmax id for the original configs (eos id 2) and for
    OWL-ViT / OWLv2 always, else the first end-of-text token (as transformers does; MetaCLIP 2 and AIMv2
    always)."""
    eos = getattr(getattr(config, "text_config", None) or config, "eos_token_id", None)
    ids = ids.to(torch.int).reshape(-1, ids.shape[-1])
    if model_type in _ARGMAX_POOLING or (model_type not in _FIRST_EOS_POOLING and (eos == 2 or eos is None)):
        return ids.argmax(dim=-1).tolist()
    return (ids == eos).int().argmax(dim=-1).tolist()
