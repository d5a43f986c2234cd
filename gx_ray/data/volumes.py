"""Reading and writing one CT volume, whatever it is stored as: NIfTI/MHA file or DICOM series folder.

Every image read in gx-ray goes through :func:`load_volume`, so a corrupt file always surfaces as the
same :class:`~gx_ray.schema.CaseError` naming the case, the file and the field.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import SimpleITK as sitk

from gx_ray.schema import CaseError

VOLUME_SUFFIXES = (".nii.gz", ".nii", ".mha", ".mhd", ".nrrd")
_NIFTI_FLOATS = {16: "f4", 64: "f8"}  # NIfTI datatype codes of float voxels
NIFTI1_HEADER_BYTES, NIFTI2_HEADER_BYTES = 348, 540
NIFTI_SLACK_BYTES = 1 << 20
"""Bytes a NIfTI file may hold beyond its header, extensions and voxels before it is refused as a gzip bomb."""
MAX_VOLUME_BYTES = 16 << 30
"""A header declaring more than this (16 GiB; a 1024x1024x4000 int16 CT is 8 GiB) is refused as corrupt."""
ORTHONORMAL_TOLERANCE = 1e-3
"""Largest entry of ``|D·Dᵀ - I|`` a direction matrix may have (float32 headers carry about 1e-7 of noise)."""
_GEOMETRY = "bad_geometry"


def is_volume_path(path: Path) -> bool:
    """A volume file, or a folder that holds a DICOM series."""
    return path.name.endswith(VOLUME_SUFFIXES) or (path.is_dir() and any(path.iterdir()))


def load_volume(path: Path, case_id: str = "?", field_name: str | None = None) -> sitk.Image:
    """Read a volume file or a DICOM series folder; any failure is a :class:`CaseError`. Besides ITK's checks, a
    NIfTI file is checked first (:func:`_check_nifti`) and every image's geometry after (:func:`check_geometry`)."""
    path = Path(path)
    try:
        if path.is_dir():
            image = _read_dicom_series(path)
        else:
            if path.name.endswith((".nii", ".nii.gz")):
                _check_nifti(path, case_id, field_name)
            image = sitk.ReadImage(str(path))
    except CaseError:
        raise
    except Exception as err:  # SimpleITK raises RuntimeError with ITK's text; keep its first line
        first_line = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise CaseError(case_id, path, field_name, f"unreadable volume: {first_line}") from err
    check_geometry(image, path, case_id, field_name)
    return image


def check_geometry(
    image: sitk.Image, path: Path | str | None, case_id: str = "?", field_name: str | None = None
) -> None:
    """Voxel spacing positive and finite, origin finite, direction orthonormal, else a ``bad_geometry`` CaseError:
    registration, resampling and boxes trust these, and a zero spacing would misplace voxels without an error."""
    where = f"{field_name}.spacing" if field_name else "spacing"
    spacing = np.asarray(image.GetSpacing(), float)
    if not np.all(np.isfinite(spacing)) or np.any(spacing <= 0):
        raise CaseError(
            case_id, path, where, f"voxel spacing must be positive and finite ({image.GetSpacing()})", _GEOMETRY
        )
    origin = np.asarray(image.GetOrigin(), float)
    if not np.all(np.isfinite(origin)):
        where = f"{field_name}.origin" if field_name else "origin"
        raise CaseError(case_id, path, where, f"origin is not finite ({image.GetOrigin()})", _GEOMETRY)
    dim = image.GetDimension()
    direction = np.reshape(image.GetDirection(), (dim, dim))
    _check_orthonormal(direction, case_id, path, f"{field_name}.direction" if field_name else "direction")


def _check_orthonormal(matrix: np.ndarray, case_id: str, path: Path | str | None, where: str) -> None:
    error = np.abs(matrix @ matrix.T - np.eye(len(matrix))).max() if np.all(np.isfinite(matrix)) else np.inf
    if not error <= ORTHONORMAL_TOLERANCE:
        values = tuple(round(float(v), 6) for v in matrix.ravel())
        message = (
            f"direction matrix is not orthonormal, |D·Dᵀ - I| = {error:.3g} > {ORTHONORMAL_TOLERANCE:g} ({values})"
        )
        raise CaseError(case_id, path, where, message, _GEOMETRY)


@dataclass(frozen=True)
class NiftiHeader:
    """The few NIfTI-1/NIfTI-2 header fields gx-ray checks before ITK reads a file."""

    version: int
    byte_order: str
    dims: tuple[int, ...]
    """Sizes of the ``dim[0]`` axes."""
    datatype: int
    bitpix: int
    pixdim: tuple[float, ...]
    """``pixdim[1 .. dim[0]]``: the voxel size along each axis."""
    vox_offset: int
    sform_code: int
    sform: np.ndarray
    """The 3x3 part of ``srow_x/y/z`` (meaningful when ``sform_code > 0``)."""

    @property
    def image_bytes(self) -> int:
        """Header, extensions and voxels: what the (decompressed) file must hold."""
        return self.vox_offset + int(np.prod(self.dims, dtype=np.int64)) * self.bitpix // 8


def parse_nifti_header(header: bytes) -> NiftiHeader | None:
    """The header fields of a NIfTI-1 (348 bytes) or NIfTI-2 (540 bytes) header, either byte order; None if neither."""
    for order in "<>":
        size = struct.unpack(order + "i", header[:4])[0] if len(header) >= 4 else 0
        if size == NIFTI1_HEADER_BYTES and len(header) >= NIFTI1_HEADER_BYTES:
            dim = struct.unpack(order + "8h", header[40:56])
            datatype, bitpix = struct.unpack(order + "2h", header[70:74])
            pixdim = struct.unpack(order + "8f", header[76:108])
            vox_offset = struct.unpack(order + "f", header[108:112])[0]
            sform_code = struct.unpack(order + "h", header[254:256])[0]
            srow = struct.unpack(order + "12f", header[280:328])
            version = 1
        elif size == NIFTI2_HEADER_BYTES and len(header) >= NIFTI2_HEADER_BYTES:
            datatype, bitpix = struct.unpack(order + "2h", header[12:16])
            dim = struct.unpack(order + "8q", header[16:80])
            pixdim = struct.unpack(order + "8d", header[104:168])
            vox_offset = struct.unpack(order + "q", header[168:176])[0]
            sform_code = struct.unpack(order + "i", header[348:352])[0]
            srow = struct.unpack(order + "12d", header[400:496])
            version = 2
        else:
            continue
        rank = min(max(int(dim[0]), 0), 7)
        return NiftiHeader(
            version=version,
            byte_order=order,
            dims=tuple(int(d) for d in dim[1 : rank + 1]),
            datatype=int(datatype),
            bitpix=int(bitpix),
            pixdim=tuple(float(p) for p in pixdim[1 : rank + 1]),
            vox_offset=int(vox_offset) if math.isfinite(vox_offset) else -1,
            sform_code=int(sform_code),
            sform=np.reshape(srow, (3, 4))[:, :3].astype(float),
        )
    return None


def _check_nifti(path: Path, case_id: str = "?", field_name: str | None = None) -> None:
    """What ITK lets through in a NIfTI file, refused here as a :class:`CaseError` naming the file and field.

    * ITK reads a truncated NIfTI without complaint and fills the missing voxels with zeros: the decompressed
      length must cover the voxels the header declares (and gzip raises on a stream cut short).
    * A gzip bomb (a small header followed by gigabytes of compressed zeros): the stream is decompressed in
      chunks and refused as soon as it runs past the header-declared size plus :data:`NIFTI_SLACK_BYTES`, so no
      more than that is ever decompressed. (The gzip trailer's ISIZE is not trusted: in a truncated file it is
      whatever bytes happen to be last.)
    * ITK turns NaN/inf float voxels into 0 (nifti1_io), so they are counted here.
    * ITK replaces a zero, NaN or infinite ``pixdim`` by 1 mm (and a negative one by its size) and silently
      ignores a sheared sform (it falls back to the qform): both are read from the header bytes here.
    """
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        try:
            header_bytes = f.read(NIFTI2_HEADER_BYTES)
        except (EOFError, OSError, zlib.error) as err:
            raise CaseError(case_id, path, field_name, f"unreadable volume: truncated or corrupt file ({err})") from err
        header = parse_nifti_header(header_bytes)
        if header is None:
            raise CaseError(
                case_id, path, field_name, "unreadable volume: not a NIfTI-1 or NIfTI-2 file (header size field)"
            )
        _check_nifti_header(header, path, case_id, field_name)
        expected = header.image_bytes
        cap = expected + NIFTI_SLACK_BYTES
        floats = _NIFTI_FLOATS.get(header.datatype)
        chunks: list[bytes] = [header_bytes]
        total = len(header_bytes)
        try:
            while total <= cap:
                chunk = f.read(min(1 << 22, cap + 1 - total))
                if not chunk:
                    break
                total += len(chunk)
                if floats:  # kept to look for NaN/inf (rare: CT is stored as integers)
                    chunks.append(chunk)
        except (EOFError, OSError, zlib.error) as err:
            raise CaseError(case_id, path, field_name, f"unreadable volume: truncated or corrupt file ({err})") from err
    if total > cap:
        message = (
            f"unreadable volume: decompresses to more than {cap} bytes, the header declares {expected} "
            f"({'x'.join(map(str, header.dims))} voxels of {header.bitpix} bits): a gzip bomb or a corrupt header"
        )
        raise CaseError(case_id, path, field_name, message)
    if total < expected:
        message = f"unreadable volume: truncated file: {total} bytes of voxel data and header, {expected} expected"
        raise CaseError(case_id, path, field_name, message)
    if floats:
        data = b"".join(chunks)
        n_voxels = int(np.prod(header.dims, dtype=np.int64))
        voxels = np.frombuffer(data, header.byte_order + floats, n_voxels, header.vox_offset)
        bad = int(np.count_nonzero(~np.isfinite(voxels)))
        if bad:
            raise CaseError(case_id, path, field_name, f"{bad} NaN or infinite voxels", reason="nan_values")


def _check_nifti_header(header: NiftiHeader, path: Path, case_id: str, field_name: str | None) -> None:
    prefix = f"{field_name}." if field_name else ""
    if not header.dims or min(header.dims) < 1 or header.bitpix <= 0 or header.bitpix % 8:
        message = f"header declares no voxels (dim {header.dims}, bitpix {header.bitpix})"
        raise CaseError(case_id, path, f"{prefix}dim", message)
    if header.vox_offset < 0:
        raise CaseError(case_id, path, f"{prefix}vox_offset", f"negative or non-finite ({header.vox_offset})")
    if header.image_bytes > MAX_VOLUME_BYTES:
        message = f"header declares {header.image_bytes} bytes of image, more than {MAX_VOLUME_BYTES} ({header.dims})"
        raise CaseError(case_id, path, f"{prefix}dim", message)
    for axis, size in enumerate(header.pixdim[:3], start=1):
        if not (math.isfinite(size) and size > 0):
            message = f"voxel spacing must be positive and finite ({size})"
            raise CaseError(case_id, path, f"{prefix}pixdim[{axis}]", message, _GEOMETRY)
    if header.sform_code > 0 and len(header.dims) >= 3:
        sform = header.sform
        norms = np.linalg.norm(sform, axis=0)
        if not (np.all(np.isfinite(sform)) and np.all(norms > 0)):
            raise CaseError(
                case_id, path, f"{prefix}srow", f"sform is degenerate ({sform.ravel().tolist()})", _GEOMETRY
            )
        _check_orthonormal(sform / norms, case_id, path, f"{prefix}srow")


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
