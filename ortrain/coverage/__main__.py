"""``python -m ortrain.coverage [--write] [--jobs N] [--only TEXT]`` (``report.py``)."""

from ortrain.coverage.report import main

if __name__ == "__main__":
    raise SystemExit(main())
