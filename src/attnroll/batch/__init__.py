"""Whole datasets: explain every input of a source into a resumable Parquet dataset, in this process or on
Ray Data, and read it back (``attnroll batch`` on the command line)."""

from .fingerprint import model_fingerprint
from .read import explanations, read_batch, read_failures, read_manifest, row_explanation
from .run import BatchMismatchError, BatchResult, run_batch
from .sources import Item, list_items
from .work import overlay_name

__all__ = ["run_batch", "BatchResult", "BatchMismatchError", "read_batch", "read_failures", "read_manifest",
           "row_explanation", "explanations", "list_items", "Item", "model_fingerprint",
           "overlay_name"]
