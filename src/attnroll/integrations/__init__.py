"""Facades over other interpretability libraries, each behind its extra and imported only by name:

- :mod:`attnroll.integrations.captum` (extra ``captum``): ``AttnrollAttribution``, any attnroll method as a
  ``captum.attr.Attribution`` (relevance shaped like the input; Captum's metrics run on it).
- :mod:`attnroll.integrations.inseq` (extra ``inseq``): attnroll methods registered as inseq attribution
  methods (``inseq.load_model(model, "attnroll_rollout", tokenizer=...)``).

TransformerLens 4 ``TransformerBridge`` and open_clip models need no facade: ``attnroll.explain`` reads them
through their capture adapters (``attnroll.capture.transformer_lens``, ``attnroll.capture.open_clip``).
"""
