"""Checkers for the chapters' exercises: one module a chapter (``mambalab.exercises.ch01`` …).

Each checker takes the reader's answer (a number, a tensor or a function), compares it with what the
package computes, and prints one line: ✓ when it is right, otherwise ✗ and how far off it is. A checker never
raises on a wrong answer, so a notebook executed headless with the exercise left blank still runs; it returns
True or False. Reference solutions live in ``tests/test_exercises_chNN*.py``.
"""


def not_attempted(answer) -> bool:
    """True, after saying so, when ``answer`` is still the exercise's blank (None or ...)."""
    if answer is None or answer is Ellipsis:
        print("… not attempted yet: replace the None (or ...) with your answer and run the cell again")
        return True
    return False


def verdict(ok: bool, right: str, wrong: str) -> bool:
    """Print ✓ ``right`` or ✗ ``wrong``; return ``ok``."""
    print(f"✓ {right}" if ok else f"✗ {wrong}")
    return ok
