"""``python -m mambalab.chapters`` and ``from mambalab import chapters``: the names under which the README's
table markers and chapter 00 reach :mod:`mambalab.workbook.chapters` (this module is that module)."""
import sys

from mambalab.workbook import chapters as _chapters

if __name__ == "__main__":
    sys.exit(_chapters.main())
sys.modules[__name__] = _chapters
