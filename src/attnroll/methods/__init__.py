"""Explanation methods: ``explain``, ``Explainer``, ``Explanation``, ``methods()``; one file per method."""

from .base import Context, Explainer, Method, explain, method_info, methods, register
from .explanation import Explanation

__all__ = ["explain", "Explainer", "Explanation", "methods", "method_info", "register", "Method", "Context"]
