"""Reading and writing one CT volume, whatever it is stored as: NIfTI/MHA file or DICOM series folder.

Every image read in gx-ray goes through :func:`load_volume`, so a corrupt file always surfaces as the
same :class:`~gx_ray.schema.CaseError` naming the case, the file and the field.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import SimpleITK as sitk

from gx_ray.schema import CaseError

VOLUME_SUFFIXES = (".nii.gz", ".nii", ".mha", ".mhd", ".nrrd")


def is_volume_path(path: Path) -> bool:
    """A volume file, or a folder that holds a DICOM series."""
    return path.name.endswith(VOLUME_SUFFIXES) or (path.is_dir() and any(path.iterdir()))


def load_volume(path: Path, case_id: str = "?", field_name: str | None = None) -> sitk.Image:
    """Read a volume file or a DICOM series folder; any failure is a :class:`CaseError`."""
    path = Path(path)
    try:
        if path.is_dir():
            return _read_dicom_series(path)
        return sitk.ReadImage(str(path))
    except CaseError:
        raise
    except Exception as err:  # SimpleITK raises RuntimeError with ITK's text; keep its first line
        first_line = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise CaseError(case_id, path, field_name, f"unreadable volume: {first_line}") from err


def _read_dicom_series(folder: Path) -> sitk.Image:
    series_ids = sitk.ImageSeriesReader.GetGDCMSeriesIDs(str(folder))
    if not series_ids:
        raise RuntimeError("no DICOM series in folder")
    if len(series_ids) > 1:
        raise RuntimeError(f"{len(series_ids)} DICOM series in one phase folder; expected one")
    files = sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(folder), series_ids[0])
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(files)
    # Every slice is decoded here, so a damaged slice fails now and not half-way through training.
    return reader.Execute()


def write_volume(image: sitk.Image, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    sitk.WriteImage(image, str(path), useCompression=True)


def write_dicom_series(image: sitk.Image, folder: Path, series_uid: str, description: str) -> None:
    """Write an int16 CT volume as one DICOM file per axial slice (the way scanners export)."""
    folder.mkdir(parents=True, exist_ok=True)
    image = sitk.Cast(image, sitk.sitkInt16)
    writer = sitk.ImageFileWriter()
    writer.KeepOriginalImageUIDOn()
    direction = image.GetDirection()
    orientation = "\\".join(
        f"{v:.6f}" for v in (direction[0], direction[3], direction[6], direction[1], direction[4], direction[7])
    )
    for z in range(image.GetDepth()):
        slice_image = image[:, :, z]
        position = image.TransformIndexToPhysicalPoint((0, 0, z))
        tags = {
            "0008|0060": "CT",
            "0008|103e": description,
            "0020|000e": series_uid,
            "0020|0013": str(z + 1),
            "0020|0032": "\\".join(f"{v:.6f}" for v in position),
            "0020|0037": orientation,
            "0018|0050": f"{image.GetSpacing()[2]:.6f}",
            "0028|1052": "0",  # rescale intercept: stored values are HU
            "0028|1053": "1",
        }
        for tag, value in tags.items():
            slice_image.SetMetaData(tag, value)
        writer.SetFileName(str(folder / f"slice_{z:04d}.dcm"))
        writer.Execute(slice_image)


def array_of(image: sitk.Image, dtype: type = np.float32) -> np.ndarray:
    """The voxels as a ``(z, y, x)`` array; NaN checks and statistics read this."""
    return sitk.GetArrayViewFromImage(image).astype(dtype, copy=False)
