"""Evaluation of saliency maps: how faithful they are (perturbation), how well they localise the object, whether
they survive a sanity check, and how a model's reliance shifts between two checkpoints.

One module per concern:

- :mod:`.perturbation`: ``deletion`` / ``insertion`` AUC (Petsiuk et al. 2018) and ``positive_perturbation`` /
  ``negative_perturbation`` AUC (Chefer et al. 2021) on image patches;
- :mod:`.text`: ``comprehensiveness`` / ``sufficiency`` AOPC on tokens (DeYoung et al. 2020, ERASER);
- :mod:`.localisation`: ``pointing_game``, ``mask_mass``, ``topk_iou`` against ground-truth masks, with exact
  chance levels;
- :mod:`.evidence_mass`, :mod:`.evidence_pointing`, :mod:`.evidence_f1`: the same questions on text, against
  ground-truth evidence tokens (``attnroll.models.evidence``);
- :mod:`.sanity`: ``cascading_randomization`` (Adebayo et al. 2018);
- :mod:`.audit`: ``audit`` two checkpoints on the same inputs (divergence, region mass shift, verdict, report);
- :mod:`.suite`: ``evaluate_methods``, every metric for several methods side by side (``attnroll evaluate``);
- :mod:`.registry`: the metric registry (``register_metric``, ``metric_info``, ``metric_names``, ``METRICS``):
  each metric's name, input kind, better direction, table format and curve labels.

The metric modules are imported first, in table order (perturbation, text, localisation, evidence); every other module
of the package is imported too, so a new metric is one new file that calls ``register_metric``.

Every function takes maps as an ``Explanation`` or a (B, units) array and runs models batched, under no_grad.
"""

# Metric modules first: their registration order is the column order of the tables.
from .perturbation import (  # isort: skip
    PerturbationResult,
    deletion,
    insertion,
    negative_perturbation,
    perturbation_curve,
    positive_perturbation,
)
from .text import comprehensiveness, sufficiency  # isort: skip
# `localisation` and `audit` are the modules, callable as their functions (see attnroll._callable)
from . import localisation  # isort: skip
from .localisation import LocalisationResult, mask_mass, pointing_game, topk_iou  # isort: skip
# the rationale metrics on text, in table order (evidence mass, pointing, top-k F1)
# (modules callable as their functions, like localisation)
from . import evidence_mass, evidence_pointing, evidence_f1  # isort: skip
from . import audit
from .audit import AuditReport, grid_regions, js_divergence, shapes_regions
from .registry import METRICS, Metric, MetricInputs, MetricValues, metric_info, metric_names, register_metric
from .sanity import SanityResult, cascading_randomization
from .suite import EvaluationResult, evaluate_methods

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
    "evidence_mass",
    "evidence_pointing",
    "evidence_f1",
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
    "Metric",
    "MetricInputs",
    "MetricValues",
    "register_metric",
    "metric_info",
    "metric_names",
]


def _import_all_modules() -> None:
    """Import every public module of the package, so that a metric in a new file registers itself."""
    import importlib
    import pkgutil

    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not m.name.startswith("_"):
            importlib.import_module(f"{__name__}.{m.name}")


_import_all_modules()
