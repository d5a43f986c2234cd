"""Acting on a sweep's answer: the chosen configuration's final model registered in MLflow
(:mod:`~gx_ray.deploy.finalize`), as files (:mod:`~gx_ray.deploy.bundle`) and an MLflow pyfunc
(:mod:`~gx_ray.deploy.pyfunc`), and predictions with an external evaluation on a new cohort
(:mod:`~gx_ray.deploy.predict`). Above :mod:`gx_ray.sweep` in the package order; nothing below imports it."""
