"""gx-ray's benchmarks: speed and memory measured as ratios within one run (gx-ray's step against the raw step of the
same model, a stream against a raw reader, a trial's loop against its step), one module per command of
``jobs/benchmark.py``. They sit beside the product: nothing under ``gx_ray/`` imports them."""
