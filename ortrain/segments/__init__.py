"""Compiled segments inside torch autograd, for models that cannot be compiled whole.

When the whole model cannot become one training graph (an export error, an op without a
gradient rule, a first step that disagrees with eager), the largest sub-modules that can
are compiled, each into a forward graph and a backward graph run by ONNX Runtime inside a
``torch.autograd.Function``; everything else runs in eager PyTorch, which differentiates
through the segments (``partition.py`` decides, ``runner.py`` runs).
"""
