"""Breadth as a measured property: every ``torch.nn`` module class and every
differentiable function of ``torch.nn.functional``, each in a small model trained through
``ORTTrainer`` and checked against eager PyTorch.

``spec.py`` (one spec: a unit, its inputs, its loss), ``nn_specs.py`` (the classes),
``functional_specs.py`` (the functions), ``check.py`` (train a spec against eager: its
outcome), ``report.py`` (``python -m ortrain.coverage --write`` writes the table of
``docs/model-coverage.md``).
"""
