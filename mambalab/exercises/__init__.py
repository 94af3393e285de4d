"""Checkers for the chapters' exercises: one module a chapter (``mambalab.exercises.ch01`` …).

Each checker takes the reader's answer (a number, a tensor or a function), compares it with what the
package computes, and prints one line: ✓ when it is right, otherwise ✗ and how far off it is. A checker never
raises on a wrong answer, so a notebook executed headless with the exercise left blank still runs; it returns
True or False. Reference solutions live in ``tests/test_exercises.py``.
"""
