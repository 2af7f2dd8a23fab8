"""Evaluation: how faithful and how well localised saliency maps are, sanity checks, checkpoint audits."""
