"""Sweeps: a search space run as Ray Tune trials, logged to MLflow (:mod:`gx_ray.sweep.driver`)."""

import os
import time

IMPORT_STARTED_AT = time.time()
"""When this package's import began: a trial process's imports (:mod:`gx_ray.sweep.trial`'s) are timed from here."""

# "The `process_trial_result` operation took 0.512 s, which may be a performance bottleneck": Tune's 0.5 s threshold
# trips on a loaded 2-core machine; 5 s still warns. Tune reads TUNE_WARN_THRESHOLD_S once, when it is first imported,
# which in a driver is after this package
os.environ.setdefault("TUNE_WARN_THRESHOLD_S", "5")
