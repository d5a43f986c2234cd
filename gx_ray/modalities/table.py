"""The lab table as a model input: abnormal values as text descriptors (the paper, Sec. 4) or a numeric vector.

Text mode keeps the shard's abnormal-value descriptors (``"CEA 12.4 ng/mL, 2.5x above upper limit"``, written by
:func:`gx_ray.data.catalogue.describe_abnormal` at preparation time) of the schema's variables only.

Numeric mode takes ``log1p`` of each schema variable over its (sex-neutral) upper reference limit: markers and enzymes
span orders of magnitude (a CEA of 500 is 100x the limit), and the log keeps them on the other inputs' scale (the
limit maps to ``log 2``). Variables without an upper limit (age, height) are ``log1p`` of the raw value; negative
values clamp to 0. The vector is ``[values..., missing flags...]``, a missing value 0 with its flag 1.
"""

from __future__ import annotations

import re
from functools import cache

import torch

from gx_ray.data.catalogue import load_catalogue
from gx_ray.modalities.schemas import ModalitySchema

NO_FINDINGS = "No abnormal laboratory findings."
FINDINGS_PREFIX = "Abnormal findings: "

# A descriptor is "<label> <number>[ unit], <amount>"; the label is everything before the first number token.
_DESCRIPTOR = re.compile(r"^(?P<label>.+?) (?P<value>[-+]?\d[\d.]*)(?:[ ,]|$)")


def table_width(schema: ModalitySchema) -> int:
    """Width of the numeric lab vector: a value and a missing flag per variable; 0 unless the table is numeric."""
    return 2 * len(schema.variables()) if schema.table == "numeric" else 0


@cache
def _variables_by_label() -> dict[str, str]:
    """Catalogue short label, label or name → variable name."""
    by_label: dict[str, str] = {}
    for v in load_catalogue():
        for key in (v.name, v.label, v.short_label):
            by_label.setdefault(key, v.name)
    return by_label


def descriptor_variable(descriptor: str) -> str:
    """The catalogue variable an abnormal-value descriptor is about (``"CEA 12.4 ng/mL, ..."`` → ``"cea"``)."""
    match = _DESCRIPTOR.match(descriptor)
    name = _variables_by_label().get(match["label"]) if match else None
    if name is None:
        # a descriptor we cannot attribute could be about any variable, a post-diagnosis one included
        raise ValueError(f"abnormal-value descriptor {descriptor!r} names no catalogue variable; re-prepare the shards")
    return name


def abnormal_text(descriptors: list[str], schema: ModalitySchema) -> str:
    """One sample's lab sentence: the descriptors of the schema's variables, or that there are none."""
    keep = set(schema.variables())
    kept = [d for d in descriptors if descriptor_variable(d) in keep]
    return FINDINGS_PREFIX + "; ".join(kept) if kept else NO_FINDINGS


@cache
def _columns_and_limits(variables: tuple[str, ...]) -> tuple[list[int], list[float]]:
    """Positions of ``variables`` in the shard's lab vector and the scale each is divided by."""
    catalogue = load_catalogue()
    order = [v.name for v in catalogue.numeric_inputs()]
    limits = [catalogue.reference_range(name)[1] or 1.0 for name in variables]
    return [order.index(name) for name in variables], limits


def numeric_table(labs: torch.Tensor, missing: torch.Tensor, schema: ModalitySchema) -> torch.Tensor:
    """``(B, 2n)`` float32: ``log1p(value / upper limit)`` of the schema's ``n`` variables, then missing flags.

    ``labs`` and ``missing`` are the shard's ``(B, N)`` columns in catalogue ``numeric_inputs()`` order.
    """
    n_inputs = len(load_catalogue().numeric_inputs())
    if labs.shape[-1] != n_inputs:
        raise ValueError(
            f"the batch's lab vector has {labs.shape[-1]} values, the catalogue {n_inputs} numeric inputs: "
            "the shards were prepared with another catalogue; re-prepare them"
        )
    columns, limits = _columns_and_limits(schema.variables())
    index = torch.tensor(columns, dtype=torch.long, device=labs.device)
    values = labs.index_select(1, index).float()
    absent = missing.index_select(1, index) | values.isnan()
    ratio = values / torch.tensor(limits, dtype=torch.float32, device=labs.device)
    scaled = torch.log1p(ratio.clamp(min=0)).masked_fill(absent, 0.0)
    return torch.cat([scaled, absent.float()], dim=1)
