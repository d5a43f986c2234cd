"""Reading and writing one CT volume, whatever it is stored as: NIfTI/MHA file or DICOM series folder.

Every image read in gx-ray goes through :func:`load_volume`, so a corrupt file always surfaces as the
same :class:`~gx_ray.schema.CaseError` naming the case, the file and the field.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np
import SimpleITK as sitk

from gx_ray.schema import CaseError

VOLUME_SUFFIXES = (".nii.gz", ".nii", ".mha", ".mhd", ".nrrd")
_NIFTI_FLOATS = {16: "f4", 64: "f8"}  # NIfTI-1 datatype codes of float voxels


def is_volume_path(path: Path) -> bool:
    """A volume file, or a folder that holds a DICOM series."""
    return path.name.endswith(VOLUME_SUFFIXES) or (path.is_dir() and any(path.iterdir()))


def load_volume(path: Path, case_id: str = "?", field_name: str | None = None) -> sitk.Image:
    """Read a volume file or a DICOM series folder; any failure is a :class:`CaseError`."""
    path = Path(path)
    try:
        if path.is_dir():
            return _read_dicom_series(path)
        if path.name.endswith((".nii", ".nii.gz")):
            _check_nifti_complete(path, case_id, field_name)
        return sitk.ReadImage(str(path))
    except CaseError:
        raise
    except Exception as err:  # SimpleITK raises RuntimeError with ITK's text; keep its first line
        first_line = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise CaseError(case_id, path, field_name, f"unreadable volume: {first_line}") from err


def _check_nifti_complete(path: Path, case_id: str = "?", field_name: str | None = None) -> None:
    """ITK reads a truncated NIfTI without complaint and fills the missing voxels with zeros: refuse it.
    It also turns NaN/inf float voxels into 0 (nifti1_io), so they are counted here.

    Reads the whole (decompressed) stream once; gzip raises on a stream cut short, and the length must cover
    the voxels the NIfTI-1 header declares.
    """
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        header = f.read(348)
        order = next((o for o in "<>" if len(header) == 348 and struct.unpack(o + "i", header[:4])[0] == 348), None)
        floats = order and _NIFTI_FLOATS.get(struct.unpack(order + "h", header[70:72])[0])
        try:
            if floats:  # kept to look for NaN/inf (rare: CT is stored as integers)
                data = header + f.read()
                total = len(data)
            else:
                total = len(header) + sum(len(chunk) for chunk in iter(lambda: f.read(1 << 22), b""))
        except (EOFError, gzip.BadGzipFile, zlib.error) as err:
            raise RuntimeError(f"truncated or corrupt file ({err})") from err
    if order is None:  # not NIfTI-1: ITK's own checks only
        return
    dims = struct.unpack(order + "8h", header[40:56])
    bitpix = struct.unpack(order + "h", header[72:74])[0]
    vox_offset = int(struct.unpack(order + "f", header[108:112])[0])
    n_voxels = int(np.prod(dims[1 : dims[0] + 1], dtype=np.int64))
    expected = vox_offset + n_voxels * bitpix // 8
    if total < expected:
        raise RuntimeError(f"truncated file: {total} bytes of voxel data and header, {expected} expected")
    if floats:
        bad = int(np.count_nonzero(~np.isfinite(np.frombuffer(data, order + floats, n_voxels, vox_offset))))
        if bad:
            raise CaseError(case_id, path, field_name, f"{bad} NaN or infinite voxels", reason="nan_values")


def _read_dicom_series(folder: Path) -> sitk.Image:
    series_ids = sitk.ImageSeriesReader.GetGDCMSeriesIDs(str(folder))
    if not series_ids:
        raise RuntimeError("no DICOM series in folder")
    if len(series_ids) > 1:
        raise RuntimeError(f"{len(series_ids)} DICOM series in one phase folder; expected one")
    files = sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(folder), series_ids[0])
    # GDCM silently leaves out files it cannot parse, which would close the gap they leave: name them instead
    stray = sorted(p.name for p in folder.iterdir() if p.is_file() and str(p) not in set(files))
    if stray:
        raise RuntimeError(f"unreadable DICOM slice(s) not in the series: {', '.join(stray[:5])}")
    _check_slice_positions(files)
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(files)
    # Every slice is decoded here, so a damaged slice fails now and not half-way through training.
    return reader.Execute()


def _check_slice_positions(files: tuple[str, ...]) -> None:
    """Equally spaced slices, or the volume would be silently stretched across a gap."""
    if len(files) < 3:
        return
    header = sitk.ImageFileReader()
    positions = []
    for name in files:
        header.SetFileName(name)
        header.ReadImageInformation()
        positions.append(header.GetOrigin())
    steps = np.linalg.norm(np.diff(np.asarray(positions), axis=0), axis=1)
    typical = float(np.median(steps))
    if typical <= 0 or np.any(np.abs(steps - typical) > 0.1 * typical):
        worst = int(np.argmax(np.abs(steps - typical)))
        raise RuntimeError(
            f"slices are not equally spaced: {steps[worst]:.2f} mm between {Path(files[worst]).name} and "
            f"{Path(files[worst + 1]).name}, {typical:.2f} mm elsewhere (a missing slice?)"
        )


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
