"""Embedded default models and their small data, loaded offline.

- :mod:`attnroll.models.shapes`: a small ViT (64x64 images, 8x8 patches) trained on procedurally generated
  shapes with ground-truth object masks (``make_dataset``, ``load_shapes_model``, ``preprocess``,
  ``CLASSES``); its training script is ``tools/train/train_shapes.py`` (in the source repository).
- :mod:`attnroll.models.spurious`: a class-coded corner marker for those images (``add_marker``) and a copy
  of the shapes ViT fine-tuned to follow it (``load_marker_model``), the test case of checkpoint audits; its
  fine-tuning script is ``tools/train/finetune_marker.py`` (in the source repository).
- :mod:`attnroll.models.state_space`: a small attention + Mamba-2 hybrid (``bamba-evidence``) and a Mamba-2 model
  (``mamba2-evidence``) trained from scratch on the evidence sentences of :mod:`attnroll.models.evidence`; their
  training script is ``tools/train/train_state_space.py`` (in the source repository).

- :mod:`attnroll.models.loading`: :func:`load_model` loads any supported model from a name or a folder
  (the embedded ones, a local transformers folder, a timm architecture with a weights file) into a
  :class:`LoadedModel` (the model, its input kind, its image preparation or tokenizer, its class names).

Submodules import their heavy dependencies (transformers, safetensors) only when a model is loaded.
"""

from .loading import LoadedModel, MissingWeightsError, PartialWeightsError, RemoteCodeError, TokenizerError, load_model

__all__ = ["LoadedModel", "MissingWeightsError", "PartialWeightsError", "RemoteCodeError", "TokenizerError",
           "load_model"]
