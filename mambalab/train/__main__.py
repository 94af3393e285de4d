"""``python -m mambalab.train`` (see :mod:`mambalab.train.cli`)."""
import mambalab  # noqa: F401  (before triton)
from mambalab.train.cli import main

raise SystemExit(main())
