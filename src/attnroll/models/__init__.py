"""Embedded default models and their small data, loaded offline.

- :mod:`attnroll.models.shapes`: a small ViT (64x64 images, 8x8 patches) trained on procedurally generated
  shapes with ground-truth object masks (``make_dataset``, ``load_shapes_model``, ``preprocess``,
  ``CLASSES``); its training script is :mod:`attnroll.models.train_shapes`.

Submodules import their heavy dependencies (transformers, safetensors) only when a model is loaded.
"""
