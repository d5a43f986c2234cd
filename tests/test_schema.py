"""AJCC 8th edition staging of gastric cancer, and the box convention."""

import pytest

from gx_ray.schema import STAGE_GROUPS, Box, CaseError, Staging, ajcc_stage, normalise_tnm, stage_group

# AJCC 8th ed. pathological stage groups (Table 17.4), written out row by row: T → stages for N0..N3b.
PTNM = {
    "T1a": ["IA", "IB", "IIA", "IIB", "IIIB"],
    "T1b": ["IA", "IB", "IIA", "IIB", "IIIB"],
    "T2": ["IB", "IIA", "IIB", "IIIA", "IIIB"],
    "T3": ["IIA", "IIB", "IIIA", "IIIB", "IIIC"],
    "T4a": ["IIB", "IIIA", "IIIA", "IIIB", "IIIC"],
    "T4b": ["IIIA", "IIIB", "IIIB", "IIIC", "IIIC"],
}


@pytest.mark.parametrize("t", list(PTNM))
def test_every_m0_cell_of_the_ptnm_table(t):
    for n, expected in zip(["N0", "N1", "N2", "N3a", "N3b"], PTNM[t], strict=True):
        assert ajcc_stage(t, n, "M0") == expected, (t, n)


def test_m1_is_stage_iv_whatever_t_and_n():
    assert {ajcc_stage(t, n, "M1") for t in PTNM for n in ("N0", "N3b")} == {"IV"}


def test_carcinoma_in_situ():
    assert ajcc_stage("Tis", "N0", "M0") == "0"
    assert stage_group("0") is None
    with pytest.raises(ValueError, match="Tis"):
        ajcc_stage("Tis", "N1", "M0")


def test_spellings_are_normalised_and_unknown_ones_refused():
    assert normalise_tnm("pT4A", "3b", "cM0") == ("T4a", "N3b", "M0")
    assert normalise_tnm("ypT2", "N1", "1") == ("T2", "N1", "M1")
    with pytest.raises(ValueError, match="valid: Tis, T1a"):
        normalise_tnm("T5", "N0", "M0")


def test_groups_cover_the_classification_labels():
    groups = {Staging(t, n, "M0").group for t in PTNM for n in ("N0", "N1", "N2", "N3a", "N3b")}
    assert groups | {Staging("T1a", "N0", "M1").group} == set(STAGE_GROUPS)
    assert stage_group("IIIC") == "III" and stage_group("IB") == "I"


def test_box_is_end_exclusive_and_validated():
    box = Box("tumour", "venous", (2, 3, 4, 3, 4, 5))
    assert box.size == (1, 1, 1)
    assert box.inside((3, 4, 5)) and not box.inside((2, 4, 5))
    with pytest.raises(ValueError, match="empty or inverted"):
        Box("tumour", "venous", (2, 3, 4, 2, 4, 5))
    with pytest.raises(ValueError, match="unknown box level"):
        Box("liver", "venous", (0, 0, 0, 1, 1, 1))


def test_case_error_names_case_file_and_field():
    err = CaseError("GX1", "/data/GX1/venous.nii.gz", "venous", "unreadable volume", "unreadable")
    assert "GX1" in str(err) and "/data/GX1/venous.nii.gz" in str(err) and "'venous'" in str(err)
    with pytest.raises(ValueError, match="unknown QC reason"):
        CaseError("GX1", None, None, "x", "because")
