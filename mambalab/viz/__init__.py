"""Visualisation for the notebooks: plotly figures, ipywidgets explorers, and helpers that show the
package's own source and check each step (:mod:`mambalab.viz.notebook`).

Import the submodule you need; this package imports nothing heavy by itself.
"""
