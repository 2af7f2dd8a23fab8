"""Evaluation of saliency maps: how faithful they are (perturbation), how well they localise the object, whether
they survive a sanity check, and how a model's reliance shifts between two checkpoints.

One module per concern:

- :mod:`.perturbation`: ``deletion`` / ``insertion`` AUC (Petsiuk et al. 2018) and ``positive_perturbation`` /
  ``negative_perturbation`` AUC (Chefer et al. 2021) on image patches;
- :mod:`.text`: ``comprehensiveness`` / ``sufficiency`` AOPC on tokens (DeYoung et al. 2020, ERASER);
- :mod:`.localisation`: ``pointing_game``, ``mask_mass``, ``topk_iou`` against ground-truth masks, with exact
  chance levels;
- :mod:`.sanity`: ``cascading_randomization`` (Adebayo et al. 2018);
- :mod:`.audit`: ``audit`` two checkpoints on the same inputs (divergence, region mass shift, verdict, report);
- :mod:`.suite`: ``evaluate_methods``, every metric for several methods side by side (``attnroll evaluate``).

Every function takes maps as an ``Explanation`` or a (B, units) array and runs models batched, under no_grad.
"""

from .audit import AuditReport, audit, grid_regions, js_divergence, shapes_regions
from .localisation import LocalisationResult, localisation, mask_mass, pointing_game, topk_iou
from .perturbation import (
    PerturbationResult,
    deletion,
    insertion,
    negative_perturbation,
    perturbation_curve,
    positive_perturbation,
)
from .sanity import SanityResult, cascading_randomization
from .suite import METRICS, EvaluationResult, evaluate_methods
from .text import comprehensiveness, sufficiency

__all__ = [
    "PerturbationResult",
    "deletion",
    "insertion",
    "positive_perturbation",
    "negative_perturbation",
    "perturbation_curve",
    "comprehensiveness",
    "sufficiency",
    "LocalisationResult",
    "localisation",
    "pointing_game",
    "mask_mass",
    "topk_iou",
    "SanityResult",
    "cascading_randomization",
    "AuditReport",
    "audit",
    "shapes_regions",
    "grid_regions",
    "js_divergence",
    "EvaluationResult",
    "evaluate_methods",
    "METRICS",
]
