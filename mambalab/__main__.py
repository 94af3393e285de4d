"""``python -m mambalab``: the same as the ``mambalab`` command (see :mod:`mambalab.cli`)."""
from mambalab.cli import main

raise SystemExit(main())
