"""Fusions: onnxscript rewriter rules (pattern / replacement), one family per module."""
