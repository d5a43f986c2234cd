"""Turning a sweep's MLflow runs into the paper's tables and radar plot, with statistics across seeds.

:mod:`~gx_ray.analysis.runs` loads the child runs of a sweep into one tidy table (the contract every other
module here reads), :mod:`~gx_ray.analysis.stats` gives confidence intervals and paired significance,
:mod:`~gx_ray.analysis.tables`, :mod:`~gx_ray.analysis.plots`, :mod:`~gx_ray.analysis.reference` and
:mod:`~gx_ray.analysis.search_views` render them, and :mod:`~gx_ray.analysis.report` writes the whole report.
"""
