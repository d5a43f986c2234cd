"""A gx-ray model as an MLflow ``pyfunc``: what the model registry holds, ``mlflow.pyfunc.load_model`` loads and
``mlflow models serve`` serves.

Its input is a cohort manifest as a table (one row per patient: a path per CT phase, the endoscopy image, lab
variables, labels if known; :mod:`gx_ray.data.manifest`), its output one row per patient: the prediction, the
members' spread where the model is an ensemble, the ways the case lies outside the training patients' fingerprint,
and, for a case that fails quality control, ``status: skipped`` with the reason (never a silent prediction). Each
case goes through :func:`gx_ray.data.prepare.case_row`, the preprocessing ``prepare_data`` runs.

The files are a :mod:`~gx_ray.deploy.bundle` (artifact ``bundle``); gx-ray must be installed where the model runs
(``mlflow models serve --env-manager local``).
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gx_ray.deploy.bundle import Predictor, outside_training, preprocess_of

STATUS_PREDICTED, STATUS_SKIPPED = "predicted", "skipped"
BUNDLE_ARTIFACT = "bundle"
"""The model's artifact holding the bundle; a downloaded model has it at ``artifacts/<the bundle's folder name>``."""


def predict_frame(predictor: Predictor, frame: pd.DataFrame, base: Path | None = None) -> pd.DataFrame:
    """One output row per manifest row of ``frame`` (relative paths from ``base``, default the working folder)."""
    from gx_ray.data.manifest import manifest_cases
    from gx_ray.data.prepare import PrepareConfig, case_row
    from gx_ray.schema import CaseError

    cases, errors = manifest_cases(frame, Path(base or Path.cwd()), "request")
    config = PrepareConfig(
        preprocess=preprocess_of(predictor.document), endoscopy_size=predictor.layout.endoscopy_shape[-1]
    )
    rows, flags, skipped = [], {}, {e.case_id: e for e in errors}
    for case in cases:
        try:
            row, qc = case_row(case, "test", config)
        except CaseError as err:
            skipped[case.case_id] = err
            continue
        rows.append(row)
        flags[case.case_id] = outside_training(qc["fingerprint"], predictor.document.get("training_fingerprint"))
    records = {str(r["case_id"]): r for r in predictor.predict_table(predictor.shard_table(rows))}
    out = []
    for case_id in [str(c) for c in frame["case_id"]]:
        if case_id in records:
            out.append({"case_id": case_id, "status": STATUS_PREDICTED, "reason": "",
                        "outside_training": "; ".join(flags[case_id]),
                        **{k: _cell(v) for k, v in records[case_id].items() if k != "case_id"}})  # fmt: skip
        else:
            err = skipped.get(case_id)
            reason = f"{err.reason}: {err}" if err is not None else "not read"
            out.append({"case_id": case_id, "status": STATUS_SKIPPED, "reason": reason, "outside_training": ""})
    return pd.DataFrame(out)


def _cell(value: Any) -> Any:
    """A record's value as one table cell (lists and dicts as JSON text: every serving format carries a string)."""
    return json.dumps(value) if isinstance(value, list | dict) else value


class GxRayModel(mlflow.pyfunc.PythonModel):
    """The pyfunc wrapper: loads the bundle on the GPU it finds (else the CPU) and predicts on manifest rows."""

    def load_context(self, context: Any) -> None:
        self.predictor = Predictor(Path(context.artifacts[BUNDLE_ARTIFACT]))

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        return predict_frame(self.predictor, model_input)


def log_pyfunc(client: MlflowClient, run_id: str, bundle: Path, name: str, card: str, alias: str,
               input_example: pd.DataFrame | None = None) -> str:  # fmt: skip
    """Log ``bundle`` as the run's pyfunc model, register it as ``name`` and point ``alias`` at the new version; the
    version's description is the model card."""
    # MLflow announces each step at INFO ("Inferring model signature ...", "Waiting up to 300 seconds ..."): the
    # summary says what was registered
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    with mlflow.start_run(run_id=run_id), warnings.catch_warnings():
        # the example's integer cells: MLflow's hint about missing integers does not apply to a manifest's text
        warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer", category=UserWarning)
        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=str(Path(__file__).with_name("served.py")),  # code, not a pickled object
            artifacts={BUNDLE_ARTIFACT: str(bundle)},
            input_example=input_example,
            pip_requirements=["gx-ray"],  # the package itself, installed where the model runs
        )
    try:
        client.create_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    version = client.create_model_version(name, info.model_uri, run_id=run_id, model_id=info.model_id).version
    client.update_model_version(name, version, description=card)
    client.set_registered_model_alias(name, alias, version)
    return str(version)
