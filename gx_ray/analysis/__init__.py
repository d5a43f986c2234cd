"""Turning a sweep's MLflow runs into the paper's tables and radar plot, with statistics across seeds.

:mod:`~gx_ray.analysis.runs` loads a sweep's child runs into one tidy table (the contract every module here reads),
:mod:`~gx_ray.analysis.stats` and :mod:`~gx_ray.analysis.study` give intervals and paired significance, tables, plots,
reference and search_views render them, and :mod:`~gx_ray.analysis.report` writes the whole report.
"""
