"""The file MLflow logs as the registered model's code (MLflow's "models from code"): loading the model runs this file,
which names :class:`~gx_ray.deploy.pyfunc.GxRayModel`, instead of unpickling a Python object."""

from mlflow.models import set_model

from gx_ray.deploy.pyfunc import GxRayModel

set_model(GxRayModel())
