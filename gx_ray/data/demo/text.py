"""The text side of a demo case: its three clinical reports (English and Chinese) and its VQA items.

Reports follow the paper's Appendix C. Each modality's text says what that modality shows:

* ``ct_report``: the imaging findings (fields of :class:`Findings` drawn from ``imaging_staging``);
* ``endoscopy_report``: the lesion as endoscopy shows it (:func:`endoscopic_lesion`, ``endoscopy_staging``);
* ``diagnosis_report``: the conclusion, stating ``text_staging`` as TNM and AJCC stage.

Every sentence has a few (English, Chinese) phrasings drawn by the case's generator: two cases with the same
findings read differently, while both languages state the same facts. VQA items (Appendix D's five categories) ask
about the same facts, answered from the closed vocabulary :data:`ANSWERS_ZH`, small enough to classify over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gx_ray.data.demo.endoscopy import EARLY_T, endoscopic_lesion
from gx_ray.data.demo.findings import (
    CURVATURES,
    GROSS_TYPES_ADVANCED,
    GROSS_TYPES_EARLY,
    INVASION_DEPTH,
    TUMOUR_LOCATIONS,
    Findings,
)
from gx_ray.schema import M_CATEGORIES, N_CATEGORIES, STAGE_GROUPS, T_CATEGORIES, VQA_CATEGORIES, Staging, VQAItem

Pair = tuple[str, str]
"""The same sentence in English and Chinese."""

LOCATION_EN = {
    "cardia": "cardia",
    "fundus": "gastric fundus",
    "body": "gastric body",
    "angle": "gastric angle",
    "antrum": "gastric antrum",
}
LOCATION_ZH = {"cardia": "贲门", "fundus": "胃底", "body": "胃体", "angle": "胃角", "antrum": "胃窦"}
CURVATURE_EN = {c: f"{c} curvature" if c in ("lesser", "greater") else c for c in CURVATURES}
CURVATURE_ZH = {"lesser": "小弯侧", "greater": "大弯侧", "anterior wall": "前壁", "posterior wall": "后壁"}
THIRD = {
    "cardia": "upper third",
    "fundus": "upper third",
    "body": "middle third",
    "angle": "lower third",
    "antrum": "lower third",
}
DEPTH_EN = {
    "intraepithelial": "the epithelium only",
    "mucosa": "the mucosa",
    "submucosa": "the submucosa",
    "muscularis propria": "the muscularis propria",
    "subserosa": "the subserosal connective tissue",
    "serosa": "the serosa",
    "adjacent organs": "adjacent structures",
}
DEPTH_ZH = {
    "intraepithelial": "上皮内",
    "mucosa": "黏膜层",
    "submucosa": "黏膜下层",
    "muscularis propria": "固有肌层",
    "subserosa": "浆膜下层",
    "serosa": "浆膜层",
    "adjacent organs": "邻近器官",
}
ULCERATED_GROSS_TYPES = ("0-III", "Borrmann II", "Borrmann III")
SIZE_BUCKETS = ((20, "under 20 mm", "小于20mm"), (40, "20-40 mm", "20-40mm"), (60, "40-60 mm", "40-60mm"))
SIZE_LARGEST = ("over 60 mm", "大于60mm")
THICKNESS_BUCKETS = ((10, "under 10 mm", "小于10mm"), (15, "10-15 mm", "10-15mm"), (20, "15-20 mm", "15-20mm"))
THICKNESS_LARGEST = ("over 20 mm", "大于20mm")
# AJCC 8th edition regional node counts of each N category
NODE_RANGE = {"N1": ("1-2", "1-2"), "N2": ("3-6", "3-6"), "N3a": ("7-15", "7-15"), "N3b": ("16 or more", "≥16")}

ANSWERS_ZH: dict[str, str] = {
    "yes": "是",
    "no": "否",
    **LOCATION_ZH,
    **{CURVATURE_EN[c]: CURVATURE_ZH[c] for c in CURVATURES},
    "upper third": "胃上部",
    "middle third": "胃中部",
    "lower third": "胃下部",
    "liver": "肝脏",
    "none": "无",
    **{g: f"{g}型" for g in GROSS_TYPES_EARLY + GROSS_TYPES_ADVANCED},
    **{en: zh for _, en, zh in SIZE_BUCKETS + THICKNESS_BUCKETS},
    SIZE_LARGEST[0]: SIZE_LARGEST[1],
    THICKNESS_LARGEST[0]: THICKNESS_LARGEST[1],
    **{depth: DEPTH_ZH[depth] for depth in INVASION_DEPTH.values()},
    "arterial": "动脉期",
    "venous": "静脉期",
    "delayed": "延迟期",
    "early hyperenhancement": "早期明显强化",
    "progressive enhancement": "渐进性强化",
    "homogeneous": "均匀",
    "heterogeneous": "不均匀",
    **{c: c for c in T_CATEGORIES + N_CATEGORIES + M_CATEGORIES},
    **{g: f"{g}期" for g in ("0", *STAGE_GROUPS)},
    "early": "早期",
    "advanced": "进展期",
}
"""The closed VQA answer vocabulary: English answer → Chinese answer."""


def make_reports(rng: np.random.Generator, findings: Findings) -> dict[str, dict[str, str]]:
    """The case's three reports, ``{"en": {kind: text}, "zh": {kind: text}}`` (kinds of ``REPORT_KINDS``)."""
    reports = {
        "ct_report": _ct_report(rng, findings),
        "endoscopy_report": _endoscopy_report(rng, findings),
        "diagnosis_report": _diagnosis_report(rng, findings),
    }
    return {
        "en": {kind: " ".join(en for en, _ in sentences) for kind, sentences in reports.items()},
        "zh": {kind: "".join(zh for _, zh in sentences) for kind, sentences in reports.items()},
    }


def _say(rng: np.random.Generator, phrasings: Sequence[Pair], en: dict[str, str], zh: dict[str, str]) -> Pair:
    """One sentence: a phrasing drawn by ``rng``, filled in with each language's values."""
    en_template, zh_template = phrasings[int(rng.integers(len(phrasings)))]
    return en_template.format(**en), zh_template.format(**zh)


def _bucket(value: float, buckets: tuple[tuple[int, str, str], ...], largest: Pair) -> Pair:
    return next(((en, zh) for limit, en, zh in buckets if value < limit), largest)


def _stage_words(t: str) -> Pair:
    return ("early", "早期") if t in EARLY_T else ("advanced", "进展期")


def _peak_phase(findings: Findings) -> str:
    """Phase of strongest enhancement: arterial if hyperenhancing, delayed for scirrhous (Borrmann IV)."""
    if findings.arterial_hyperenhancement:
        return "arterial"
    return "delayed" if findings.gross_type == "Borrmann IV" else "venous"


def _heterogeneous(findings: Findings) -> bool:
    # deep, bulky tumours are necrotic in places
    return findings.imaging_staging.t in ("T3", "T4a", "T4b")


# --- CT report ---------------------------------------------------------------------------------------

CT_TECHNIQUE: tuple[Pair, ...] = (
    (
        "Multiphase contrast-enhanced CT of the upper abdomen (non-contrast, arterial, venous and delayed phases).",
        "上腹部CT平扫及多期增强扫描（平扫期、动脉期、静脉期、延迟期）。",
    ),
    ("Non-contrast and triphasic contrast-enhanced abdominal CT.", "腹部CT平扫+三期增强扫描。"),
    (
        "Plain CT of the upper abdomen followed by arterial, portal venous and delayed phase imaging.",
        "上腹部CT平扫加动脉期、门静脉期及延迟期增强扫描。",
    ),
)
CT_WALL_ADVANCED: tuple[Pair, ...] = (
    (
        "Irregular wall thickening is seen in the {loc} along the {curv}, up to {wall} mm thick.",
        "{loc}{curv}胃壁不规则增厚，最厚处约{wall}mm。",
    ),
    (
        "The wall of the {loc} is thickened at the {curv}, with a maximal thickness of about {wall} mm.",
        "{loc}{curv}胃壁增厚，较厚处约{wall}mm。",
    ),
    (
        "There is focal thickening of the gastric wall in the {loc} ({curv}), approximately {wall} mm thick.",
        "{loc}{curv}见局限性胃壁增厚，厚约{wall}mm。",
    ),
)
CT_WALL_EARLY: tuple[Pair, ...] = (
    (
        "Subtle focal mucosal thickening is seen in the {loc} along the {curv}, about {wall} mm thick.",
        "{loc}{curv}黏膜局限性稍增厚，厚约{wall}mm。",
    ),
    (
        "The mucosa of the {loc} at the {curv} is slightly thickened, measuring about {wall} mm.",
        "{loc}{curv}黏膜面略增厚，厚约{wall}mm。",
    ),
)
CT_LESION: tuple[Pair, ...] = (
    ("The lesion measures about {size} mm in its long axis{morph}.", "病灶长径约{size}mm{morph}。"),
    ("Its long axis is approximately {size} mm{morph}.", "病变长径约{size}mm{morph}。"),
)
CT_MORPHOLOGY: dict[str, Pair] = {
    "0-I": (", protruding slightly into the lumen", "，稍向腔内突起"),
    "0-IIa": (", slightly elevated", "，略隆起"),
    "0-IIc": (", with a shallow mucosal depression", "，黏膜面见浅凹陷"),
    "0-III": (", with a small mucosal ulcer", "，黏膜面见小溃疡"),
    "Borrmann I": (", protruding into the lumen as a polypoid mass", "，呈息肉样肿块突向腔内"),
    "Borrmann II": (", with a central ulcer and raised margins", "，中央见溃疡，周边隆起"),
    "Borrmann III": (", with an ulcer and ill-defined infiltrative margins", "，表面溃疡形成，边界不清"),
    "Borrmann IV": (", diffusely infiltrating the wall with a rigid, narrowed lumen", "，呈弥漫浸润，胃腔僵硬变窄"),
}
CT_ENHANCEMENT: dict[str, tuple[Pair, ...]] = {
    "arterial": (
        (
            "It shows marked, {homog} enhancement in the arterial phase that persists in the venous and delayed "
            "phases.",
            "增强扫描动脉期明显{homog}强化，静脉期及延迟期持续强化。",
        ),
        (
            "On contrast-enhanced images it enhances avidly and {homog}ly in the arterial phase.",
            "增强后动脉期呈明显{homog}强化。",
        ),
    ),
    "venous": (
        (
            "It enhances mildly in the arterial phase and progressively, {homog}ly, peaking in the venous phase.",
            "增强扫描动脉期轻度强化，静脉期强化达峰，呈{homog}渐进性强化。",
        ),
        (
            "Enhancement is {homog} and progressive, strongest in the portal venous phase.",
            "增强后呈{homog}渐进性强化，门静脉期强化最明显。",
        ),
    ),
    "delayed": (
        (
            "It enhances slowly and {homog}ly, with progressive enhancement peaking in the delayed phase.",
            "增强扫描呈{homog}缓慢渐进性强化，延迟期强化最明显。",
        ),
        (
            "Progressive {homog} enhancement is seen, most marked in the delayed phase.",
            "病灶呈渐进性{homog}强化，延迟期最明显。",
        ),
    ),
}
CT_DEPTH: dict[str, tuple[Pair, ...]] = {
    "Tis": (
        (
            "The change is confined to the epithelium only; the outer wall is smooth and the perigastric fat is clear.",
            "病变局限于上皮内，浆膜面光整，胃周脂肪间隙清晰。",
        ),
    ),
    "T1a": (
        (
            "The lesion appears confined to the mucosa; the serosal surface is smooth and the fat plane is preserved.",
            "病变局限于黏膜层，浆膜面光整，胃周脂肪间隙清晰。",
        ),
        (
            "The low-attenuation submucosal layer is intact, suggesting involvement of the mucosa only.",
            "黏膜下低密度层完整，考虑仅累及黏膜层。",
        ),
    ),
    "T1b": (
        (
            "The submucosal layer is partly interrupted, suggesting invasion of the submucosa; the serosa is smooth.",
            "黏膜下低密度层部分中断，考虑侵及黏膜下层，浆膜面光整。",
        ),
    ),
    "T2": (
        (
            "The tumour involves the muscularis propria; the serosal surface remains smooth and the perigastric fat is "
            "clear.",
            "病变累及固有肌层，浆膜面尚光整，胃周脂肪间隙清晰。",
        ),
        (
            "Enhancement extends into the muscularis propria without reaching the serosa.",
            "强化累及固有肌层，未达浆膜面。",
        ),
    ),
    "T3": (
        (
            "The serosal surface is slightly irregular with mild perigastric fat stranding, suggesting invasion of the "
            "subserosa.",
            "浆膜面稍毛糙，胃周脂肪间隙见少许索条影，考虑侵及浆膜下层。",
        ),
        (
            "Fine strands in the perigastric fat suggest subserosa invasion; the serosal line is still traceable.",
            "胃周脂肪间隙少许渗出，浆膜线尚可辨，考虑侵及浆膜下层。",
        ),
    ),
    "T4a": (
        (
            "The serosal surface is rough with nodular projections and perigastric fat infiltration, suggesting "
            "invasion of the serosa.",
            "浆膜面毛糙，可见结节状突起，胃周脂肪间隙模糊，考虑浆膜层受侵。",
        ),
        (
            "The serosa is irregular and the surrounding fat is infiltrated, consistent with invasion of the serosa.",
            "浆膜面不光整，周围脂肪间隙浸润，符合浆膜层受侵。",
        ),
    ),
    "T4b": (
        (
            "The tumour extends through the serosa with perigastric fat infiltration and loss of the fat plane with "
            "the {organ}, suggesting invasion of adjacent organs.",
            "肿瘤突破浆膜，胃周脂肪间隙浸润，与{organ}分界不清，考虑侵犯邻近器官。",
        ),
    ),
}
ADJACENT_ORGANS: tuple[Pair, ...] = (
    ("pancreas", "胰腺"),
    ("transverse colon", "横结肠"),
    ("left lobe of the liver", "肝左叶"),
    ("spleen", "脾脏"),
)
CT_NODES_NONE: tuple[Pair, ...] = (
    ("No enlarged perigastric lymph nodes are seen.", "胃周未见明显肿大淋巴结。"),
    ("There is no perigastric or regional lymphadenopathy.", "胃周及区域未见肿大淋巴结。"),
)
CT_NODES_ONE: tuple[Pair, ...] = (
    (
        "1 enlarged perigastric lymph node is seen, short axis about {node_max} mm.",
        "胃周见1枚肿大淋巴结，短径约{node_max}mm。",
    ),
    (
        "A single enlarged lymph node lies next to the stomach, {node_max} mm in short axis.",
        "胃周见单发淋巴结肿大，短径约{node_max}mm。",
    ),
)
CT_NODES_MANY: tuple[Pair, ...] = (
    (
        "{n_nodes} enlarged perigastric lymph nodes are seen, the largest about {node_max} mm in short axis.",
        "胃周见多发肿大淋巴结（{n_nodes}枚），较大者短径约{node_max}mm。",
    ),
    (
        "Multiple enlarged lymph nodes ({n_nodes}) surround the stomach; the largest short axis is {node_max} mm.",
        "胃周见多发淋巴结肿大（{n_nodes}枚），最大短径约{node_max}mm。",
    ),
)
CT_LIVER_NONE: tuple[Pair, ...] = (
    ("No focal liver lesion is seen.", "肝脏未见明确占位性病变。"),
    ("The liver shows no focal lesion.", "肝内未见异常强化灶。"),
)
CT_LIVER_METS: tuple[Pair, ...] = (
    (
        "{n_mets} ring-enhancing low-attenuation {lesions} seen in the liver, the largest about {met_max} mm, "
        "suggestive of liver metastases.",
        "肝内见{n_mets}个低密度灶，较大者约{met_max}mm，增强扫描呈环形强化，考虑肝转移。",
    ),
    (
        "Liver: {n_mets} rim-enhancing hypodense {lesions} present, up to {met_max} mm, in keeping with metastases.",
        "肝内见{n_mets}个环形强化低密度灶，最大约{met_max}mm，符合肝转移。",
    ),
)
CT_ASCITES: dict[bool, tuple[Pair, ...]] = {
    True: (
        ("A small amount of ascites is present.", "腹盆腔见少量积液。"),
        ("There is ascites in the abdomen and pelvis.", "腹腔及盆腔见积液。"),
    ),
    False: (("No ascites.", "腹腔未见积液。"), ("There is no free fluid in the abdomen.", "腹腔内未见游离积液。")),
}
CT_INCIDENTAL: tuple[Pair, ...] = (
    ("Incidentally, a simple cyst is seen in the left kidney.", "另见左肾单纯性囊肿。"),
    ("Incidental gallbladder stones are noted.", "另见胆囊结石。"),
    ("Incidental small calcification in the spleen.", "另见脾内小钙化灶。"),
    ("Mild diffuse fatty infiltration of the liver is noted.", "另见轻度脂肪肝。"),
)
CT_IMPRESSION: tuple[Pair, ...] = (
    (
        "Impression: {stage} gastric carcinoma of the {loc} ({gross}){spread}.",
        "诊断意见：{loc}{stage}胃癌（{gross}）{spread}。",
    ),
    (
        "Conclusion: findings consistent with {stage} gastric cancer in the {loc}, {gross} type{spread}.",
        "影像诊断：{loc}{stage}胃癌可能性大，{gross}{spread}。",
    ),
)


def _ct_report(rng: np.random.Generator, f: Findings) -> list[Pair]:
    t = f.imaging_staging.t
    organ = ADJACENT_ORGANS[int(rng.integers(len(ADJACENT_ORGANS)))]
    spread = [
        part
        for present, part in (
            (f.n_nodes > 0, ("perigastric lymph node metastases", "胃周淋巴结转移")),
            (f.n_liver_mets > 0, ("liver metastases", "肝转移")),
            (f.ascites, ("ascites", "腹水")),
        )
        if present
    ]
    homog = ("heterogeneous", "不均匀") if _heterogeneous(f) else ("homogeneous", "均匀")
    stage = _stage_words(t)
    values = {
        "loc": (LOCATION_EN[f.tumour_location], LOCATION_ZH[f.tumour_location]),
        "curv": (CURVATURE_EN[f.tumour_curvature], CURVATURE_ZH[f.tumour_curvature]),
        "wall": (f"{f.wall_thickness_mm:.1f}",) * 2,
        "size": (f"{f.tumour_size_mm:.1f}",) * 2,
        "morph": CT_MORPHOLOGY[f.gross_type],
        "homog": homog,
        "organ": organ,
        "n_nodes": (str(f.n_nodes),) * 2,
        "node_max": (f"{max(f.node_short_axes_mm, default=0):.1f}",) * 2,
        "n_mets": (str(f.n_liver_mets),) * 2,
        "met_max": (f"{max(f.liver_met_sizes_mm, default=0):.1f}",) * 2,
        "lesions": ("lesion is" if f.n_liver_mets == 1 else "lesions are", ""),
        "stage": stage,
        "gross": (f.gross_type, ANSWERS_ZH[f.gross_type]),
        "spread": (
            ", with " + " and ".join(", ".join(en for en, _ in spread).rsplit(", ", 1)) if spread else "",
            "，伴" + "、".join(zh for _, zh in spread) if spread else "",
        ),
    }
    en = {k: v[0] for k, v in values.items()}
    zh = {k: v[1] for k, v in values.items()}
    nodes = CT_NODES_NONE if f.n_nodes == 0 else CT_NODES_ONE if f.n_nodes == 1 else CT_NODES_MANY
    sentences = [
        _say(rng, CT_TECHNIQUE, en, zh) if rng.random() < 0.6 else None,
        _say(rng, CT_WALL_EARLY if t in EARLY_T else CT_WALL_ADVANCED, en, zh),
        _say(rng, CT_LESION, en, zh),
        _say(rng, CT_ENHANCEMENT[_peak_phase(f)], en, zh),
        _say(rng, CT_DEPTH[t], en, zh),
        _say(rng, nodes, en, zh),
        _say(rng, CT_LIVER_METS if f.n_liver_mets else CT_LIVER_NONE, en, zh),
        _say(rng, CT_ASCITES[f.ascites], en, zh),
        _say(rng, CT_INCIDENTAL, en, zh) if rng.random() < 0.3 else None,
        _say(rng, CT_IMPRESSION, en, zh),
    ]
    return [s for s in sentences if s is not None]


# --- endoscopy report --------------------------------------------------------------------------------

ENDO_INTRO: tuple[Pair, ...] = (
    ("The scope was passed smoothly into the descending duodenum.", "内镜顺利通过咽部，进镜至十二指肠降部。"),
    ("The endoscope was advanced without difficulty to the second part of the duodenum.", "进镜顺利，达十二指肠降段。"),
    ("Gastroscopy under sedation; the scope reached the descending duodenum.", "无痛胃镜检查，内镜达十二指肠降部。"),
)
ENDO_OESOPHAGUS: tuple[Pair, ...] = (
    ("The oesophageal mucosa is smooth and the dentate line is clear.", "食管黏膜光滑，齿状线清晰。"),
    ("The oesophagus is unremarkable.", "食管未见明显异常。"),
)
ENDO_WHERE: tuple[Pair, ...] = (
    ("On the {curv} of the {loc} there is", "{loc}{curv}见"),
    ("In the {loc}, on the {curv}, there is", "于{loc}{curv}见"),
    ("At the {curv} of the {loc} there is", "{loc}近{curv}处见"),
)
ENDO_LESION: dict[str, Pair] = {
    "0-I": (
        "a protruded lesion of about {size} × {short} mm with a reddish, uneven surface.",
        "一大小约{size}×{short}mm的隆起型病变，表面发红，凹凸不平。",
    ),
    "0-IIa": (
        "a slightly elevated, flat lesion of about {size} × {short} mm with a pale, granular surface.",
        "一大小约{size}×{short}mm的浅表隆起型病变，表面发白，呈颗粒状。",
    ),
    "0-IIc": (
        "a shallow depressed lesion of about {size} × {short} mm with reddened mucosa and an irregular margin.",
        "一大小约{size}×{short}mm的浅表凹陷型病变，黏膜发红，边缘不规则。",
    ),
    "0-III": (
        "an excavated lesion of about {size} × {short} mm with a shallow ulcer covered by white coating.",
        "一大小约{size}×{short}mm的凹陷型病变，中央浅溃疡，覆白苔。",
    ),
    "Borrmann I": (
        "a cauliflower-like protruding mass of about {size} × {short} mm with surface erosion and contact bleeding.",
        "一大小约{size}×{short}mm的菜花样隆起性肿物，表面糜烂，触之易出血。",
    ),
    "Borrmann II": (
        "an ulcerated mass of about {size} × {short} mm; the ulcer base is covered with dirty white fibrin and "
        "surrounded by a sharply demarcated raised rim.",
        "一大小约{size}×{short}mm的溃疡型肿物，底覆污秽白苔，周边呈堤样隆起，边界清楚。",
    ),
    "Borrmann III": (
        "an ulcerative infiltrative lesion of about {size} × {short} mm with an irregular raised rim, ill-defined "
        "margins and a base covered with dirty fibrin.",
        "一大小约{size}×{short}mm的溃疡浸润型病变，周堤不规则，边界不清，底覆污秽苔。",
    ),
    "Borrmann IV": (
        "diffuse infiltration over about {size} × {short} mm with thickened, rigid folds and pale, uneven mucosa.",
        "范围约{size}×{short}mm的弥漫浸润性病变，皱襞粗大僵硬，黏膜苍白、粗糙不平。",
    ),
}
ENDO_DEPTH: dict[str, tuple[Pair, ...]] = {
    "Tis": (
        (
            "Magnifying endoscopy with narrow-band imaging shows a clear demarcation line with an irregular "
            "microvascular pattern; the lesion appears confined to the epithelium.",
            "放大内镜结合NBI观察可见清晰分界线，微血管结构不规则，病变考虑局限于上皮内。",
        ),
    ),
    "T1a": (
        (
            "Magnifying endoscopy with narrow-band imaging shows a demarcation line with irregular microvascular and "
            "microsurface patterns; the lesion appears confined to the mucosa.",
            "放大内镜结合NBI观察可见分界线，微血管及微表面结构不规则，病变考虑局限于黏膜层。",
        ),
        (
            "Under NBI there is a demarcation line and an irregular pit pattern without fold convergence, suggesting "
            "mucosal involvement only.",
            "NBI下可见分界线，腺管开口形态不规则，未见皱襞集中，考虑局限于黏膜层。",
        ),
    ),
    "T1b": (
        (
            "Mild fold convergence and slight thickening at the margin suggest submucosal invasion.",
            "病变周围皱襞轻度集中、稍增粗，考虑侵及黏膜下层。",
        ),
        (
            "The lesion is slightly firm with fold convergence; submucosal invasion is suspected.",
            "病变质稍硬，伴皱襞集中，疑侵及黏膜下层。",
        ),
    ),
    "T2": (
        (
            "The surrounding wall is mildly stiff, with preserved distensibility on insufflation.",
            "周围胃壁稍僵硬，充气后扩张尚可。",
        ),
        ("The lesion is firm; the adjacent wall distends reasonably well.", "病变质硬，邻近胃壁扩张尚可。"),
    ),
    "T3": (
        ("The gastric wall around the lesion is rigid with poor peristalsis.", "病变周围胃壁僵硬，蠕动差。"),
        (
            "The lesion is hard and friable, and the adjacent wall is stiff on insufflation.",
            "病变质硬而脆，邻近胃壁充气扩张差。",
        ),
    ),
    "T4a": (
        (
            "The lesion is extensive; the wall is markedly rigid, peristalsis is absent and the lumen is narrowed.",
            "病变范围广，胃壁明显僵硬，蠕动消失，胃腔狭窄。",
        ),
        (
            "The wall is markedly rigid and does not distend; the lumen is deformed.",
            "胃壁明显僵硬，充气不能扩张，胃腔变形。",
        ),
    ),
}
ENDO_DEPTH["T4b"] = ENDO_DEPTH["T4a"]
BIOPSY_SITE: dict[str, Pair] = {
    "0-I": ("surface", "表面"),
    "0-IIa": ("surface", "表面"),
    "0-IIc": ("depressed centre", "凹陷处"),
    "0-III": ("ulcer margin", "溃疡边缘"),
    "Borrmann I": ("surface", "表面"),
    "Borrmann II": ("ulcer margin", "溃疡边缘"),
    "Borrmann III": ("ulcer margin", "溃疡边缘"),
    "Borrmann IV": ("thickened folds", "增厚皱襞处"),
}
ENDO_BIOPSY: tuple[Pair, ...] = (
    ("{n_biopsies} biopsy specimens were taken from the {site} of the lesion.", "于病变{site}活检{n_biopsies}块。"),
    ("Biopsy: {n_biopsies} pieces from the {site}, sent for pathology.", "取病变{site}组织{n_biopsies}块送病理检查。"),
)
ENDO_CONCLUSION: tuple[Pair, ...] = (
    (
        "Endoscopic diagnosis: {stage} gastric cancer of the {loc} ({gross}); pending pathology.",
        "内镜诊断：{loc}{stage}胃癌（{gross}），待病理结果。",
    ),
    (
        "Impression: lesion of the {loc}, suspicious for {stage} gastric carcinoma ({gross}); await biopsy results.",
        "诊断：{loc}病变，考虑{stage}胃癌（{gross}），待活检病理。",
    ),
)


def _endoscopy_report(rng: np.random.Generator, f: Findings) -> list[Pair]:
    lesion = endoscopic_lesion(f)
    values = {
        "loc": (LOCATION_EN[lesion.location], LOCATION_ZH[lesion.location]),
        "curv": (CURVATURE_EN[lesion.curvature], CURVATURE_ZH[lesion.curvature]),
        "size": (str(lesion.size_mm),) * 2,
        "short": (str(lesion.short_mm),) * 2,
        "site": BIOPSY_SITE[lesion.gross_type],
        "n_biopsies": (str(int(rng.integers(2, 7))),) * 2,
        "stage": _stage_words(lesion.t),
        "gross": (lesion.gross_type, ANSWERS_ZH[lesion.gross_type]),
    }
    en = {k: v[0] for k, v in values.items()}
    zh = {k: v[1] for k, v in values.items()}
    where_en, where_zh = _say(rng, ENDO_WHERE, en, zh)
    what_en, what_zh = (
        template.format(**values) for template, values in zip(ENDO_LESION[lesion.gross_type], (en, zh), strict=True)
    )
    sentences = [
        _say(rng, ENDO_INTRO, en, zh),
        _say(rng, ENDO_OESOPHAGUS, en, zh) if rng.random() < 0.7 else None,
        (f"{where_en} {what_en}", where_zh + what_zh),
        _say(rng, ENDO_DEPTH[lesion.t], en, zh),
        _say(rng, ENDO_BIOPSY, en, zh),
        _say(rng, ENDO_CONCLUSION, en, zh),
    ]
    return [s for s in sentences if s is not None]


# --- diagnosis report --------------------------------------------------------------------------------

DX_MALIGNANCY: tuple[Pair, ...] = (
    ("Findings are highly suggestive of gastric adenocarcinoma of the {loc}.", "考虑{loc}胃腺癌可能性大。"),
    (
        "The overall picture is consistent with a malignant tumour of the {loc} (gastric carcinoma).",
        "综合考虑{loc}恶性肿瘤（胃癌）。",
    ),
    ("Malignant: {stage} gastric cancer of the {loc}.", "恶性：{loc}{stage}胃癌。"),
)
DX_DEPTH: tuple[Pair, ...] = (
    ("The tumour is estimated to invade {depth} ({t}).", "肿瘤估计侵及{depth}（{t}）。"),
    ("Depth of invasion: {depth} ({t}).", "浸润深度：{depth}（{t}）。"),
)
DX_NODES: dict[bool, tuple[Pair, ...]] = {
    False: (
        ("No regional lymph node metastasis is suspected ({n}).", "未见区域淋巴结转移征象（{n}）。"),
        ("Regional lymph nodes: not involved ({n}).", "区域淋巴结：未见转移（{n}）。"),
    ),
    True: (
        (
            "Regional lymph node metastasis is suspected, in keeping with {n} ({node_range} nodes).",
            "考虑区域淋巴结转移，{n}（{node_range}枚）。",
        ),
        (
            "Regional nodal involvement: {n} ({node_range} positive nodes).",
            "区域淋巴结转移：{n}（{node_range}枚阳性）。",
        ),
    ),
}
DX_DISTANT: dict[bool, tuple[Pair, ...]] = {
    False: (
        ("No distant metastasis ({m}).", "未见远处转移（{m}）。"),
        ("Distant spread: none ({m}).", "远处转移：无（{m}）。"),
    ),
    True: (
        ("Distant metastasis is present ({m}).", "存在远处转移（{m}）。"),
        ("Distant spread: present ({m}).", "远处转移：有（{m}）。"),
    ),
}
DX_STAGE: tuple[Pair, ...] = (
    ("Estimated clinical stage: c{t}{n}{m}, stage {stage}.", "临床分期：c{t}{n}{m}，{stage}期。"),
    ("TNM: c{t}{n}{m} (AJCC 8th edition stage {stage}).", "TNM分期：c{t}{n}{m}（AJCC第8版 {stage}期）。"),
)
DX_RECOMMENDATION: dict[str, tuple[Pair, ...]] = {
    "local": (
        (
            "Endoscopic submucosal dissection or limited resection may be considered after pathological confirmation.",
            "病理证实后可考虑内镜黏膜下剥离术（ESD）或局限性切除。",
        ),
        (
            "Recommend correlation with biopsy pathology and evaluation for endoscopic resection.",
            "建议结合活检病理，评估内镜下切除。",
        ),
    ),
    "resectable": (
        (
            "Radical gastrectomy with D2 lymphadenectomy is recommended; consider perioperative chemotherapy.",
            "建议行根治性胃切除术+D2淋巴结清扫，可考虑围手术期化疗。",
        ),
        (
            "Recommend multidisciplinary review for radical surgery (D2 dissection) with perioperative chemotherapy.",
            "建议多学科讨论，行根治性手术（D2清扫）并围手术期化疗。",
        ),
    ),
    "metastatic": (
        (
            "Systemic therapy and multidisciplinary team discussion are recommended.",
            "建议全身系统治疗，多学科会诊（MDT）。",
        ),
        (
            "Recommend palliative systemic chemotherapy; surgery only for complications.",
            "建议姑息性全身化疗，手术仅用于处理并发症。",
        ),
    ),
}


def _diagnosis_report(rng: np.random.Generator, f: Findings) -> list[Pair]:
    staging: Staging = f.text_staging
    depth = INVASION_DEPTH[staging.t]
    if staging.m == "M1":
        plan = "metastatic"
    elif staging.t in EARLY_T and staging.n == "N0":
        plan = "local"
    else:
        plan = "resectable"
    values = {
        "loc": (LOCATION_EN[f.tumour_location], LOCATION_ZH[f.tumour_location]),
        "stage": (staging.stage, staging.stage),
        "depth": (DEPTH_EN[depth], DEPTH_ZH[depth]),
        "node_range": NODE_RANGE.get(staging.n, ("0", "0")),
        **{k: (v, v) for k, v in (("t", staging.t), ("n", staging.n), ("m", staging.m))},
    }
    en = {k: v[0] for k, v in values.items()}
    zh = {k: v[1] for k, v in values.items()}
    words = _stage_words(staging.t)
    return [
        _say(rng, DX_MALIGNANCY, {**en, "stage": words[0]}, {**zh, "stage": words[1]}),
        _say(rng, DX_DEPTH, en, zh),
        _say(rng, DX_NODES[staging.n != "N0"], en, zh),
        _say(rng, DX_DISTANT[staging.m == "M1"], en, zh),
        _say(rng, DX_STAGE, en, zh),
        _say(rng, DX_RECOMMENDATION[plan], en, zh),
    ]


# --- VQA ---------------------------------------------------------------------------------------------


QUESTIONS: dict[str, dict[str, tuple[Pair, ...]]] = {
    "lesion": {
        "gross_type": (
            ("What is the gross type of the lesion?", "病灶的大体分型是什么？"),
            ("Which macroscopic type does the tumour show?", "肿瘤的大体类型为哪一型？"),
        ),
        "size": (
            ("How large is the lesion along its long axis?", "病灶长径多大？"),
            ("What is the size range of the tumour?", "肿瘤大小属于哪个范围？"),
        ),
        "thickness": (
            ("How thick is the gastric wall at the lesion?", "病灶处胃壁厚度为多少？"),
            ("What is the maximal wall thickness?", "胃壁最大厚度属于哪个范围？"),
        ),
        "depth": (
            ("How deep does the lesion invade the gastric wall?", "病灶侵及胃壁哪一层？"),
            ("Which layer does the tumour reach?", "肿瘤浸润深度达到哪一层？"),
        ),
    },
    "enhancement": {
        "peak_phase": (
            ("In which phase does the lesion enhance most?", "病灶在哪一期强化最明显？"),
            ("Which contrast phase shows the strongest tumour enhancement?", "哪一期相肿瘤强化程度最高？"),
        ),
        "pattern": (
            ("What is the enhancement pattern of the lesion?", "病灶的强化方式是什么？"),
            ("How does the tumour enhance after contrast?", "增强后肿瘤呈何种强化方式？"),
        ),
        "homogeneity": (
            ("Is the enhancement homogeneous or heterogeneous?", "病灶强化是否均匀？"),
            ("How uniform is the enhancement of the lesion?", "病灶强化均匀程度如何？"),
        ),
    },
    "staging": {
        "t": (("What is the T category?", "T分期是什么？"), ("Which T stage is estimated?", "估计的T分期为？")),
        "n": (("What is the N category?", "N分期是什么？"), ("Which N stage is estimated?", "估计的N分期为？")),
        "m": (("What is the M category?", "M分期是什么？"), ("Which M stage is estimated?", "估计的M分期为？")),
        "group": (
            ("What is the overall stage group?", "总体分期属于哪一期？"),
            ("Which clinical stage group is the tumour?", "肿瘤的临床分期为几期？"),
        ),
        "early_advanced": (
            ("Is this early or advanced gastric cancer?", "这是早期还是进展期胃癌？"),
            ("Is the cancer early or advanced?", "该胃癌属于早期还是进展期？"),
        ),
    },
    "localization": {
        "location": (
            ("Where is the tumour located?", "肿瘤位于胃的哪个部位？"),
            ("In which part of the stomach is the lesion?", "病灶位于胃的什么部位？"),
        ),
        "curvature": (
            ("Which wall or curvature does the lesion involve?", "病灶累及哪一侧胃壁？"),
            ("On which side of the stomach is the tumour?", "肿瘤位于胃的哪一侧？"),
        ),
        "third": (
            ("Which third of the stomach holds the tumour?", "肿瘤位于胃的上、中、下哪一部分？"),
            ("Is the lesion in the upper, middle or lower stomach?", "病灶位于胃上部、中部还是下部？"),
        ),
        "metastasis_site": (
            ("Where are distant metastases seen?", "远处转移灶位于何处？"),
            ("Which organ shows metastatic lesions?", "哪个器官可见转移灶？"),
        ),
    },
}
"""Category → question key → its phrasings; :func:`_question_pool` answers them."""


@dataclass(frozen=True)
class _Question:
    category: str
    key: str
    """What is asked; a case never gets the same ``key`` twice."""
    phrasings: tuple[Pair, ...]
    answer: str
    """English answer, a key of :data:`ANSWERS_ZH`."""


def make_vqa(rng: np.random.Generator, findings: Findings, n_items: int = 8) -> dict[str, list[VQAItem]]:
    """``n_items`` question-answer pairs (fewer only past the ~30 a case has), the same in ``"en"`` and ``"zh"``:
    categories take turns in a random order (``n_items >= 5`` covers all five), yes/no answers are even; staging
    answers come from ``text_staging`` (what the reports say), the others from the imaging findings."""
    pool = _question_pool(rng, findings)
    order = [str(c) for c in rng.permutation(VQA_CATEGORIES)]
    chosen: list[tuple[_Question, Pair]] = []
    used: set[str] = set()
    turn = 0
    while len(chosen) < n_items and any(q.key not in used for q in pool):
        category = order[turn % len(order)]
        turn += 1
        candidates = [q for q in pool if q.category == category and q.key not in used]
        if category == "yes_no":
            wanted = "yes" if rng.random() < 0.5 else "no"
            candidates = [q for q in candidates if q.answer == wanted] or candidates
        if not candidates:
            continue
        question = candidates[int(rng.integers(len(candidates)))]
        used.add(question.key)
        chosen.append((question, question.phrasings[int(rng.integers(len(question.phrasings)))]))
    return {
        "en": [VQAItem(en, q.answer, q.category) for q, (en, _) in chosen],
        "zh": [VQAItem(zh, ANSWERS_ZH[q.answer], q.category) for q, (_, zh) in chosen],
    }


def _question_pool(rng: np.random.Generator, f: Findings) -> list[_Question]:
    """Every question the case can answer, with its answer."""
    imaging_t, text = f.imaging_staging.t, f.text_staging
    size_bucket = _bucket(f.tumour_size_mm, SIZE_BUCKETS, SIZE_LARGEST)[0]
    thickness_bucket = _bucket(f.wall_thickness_mm, THICKNESS_BUCKETS, THICKNESS_LARGEST)[0]
    answers = {
        "gross_type": f.gross_type,
        "size": size_bucket,
        "thickness": thickness_bucket,
        "depth": f.invasion_depth,
        "peak_phase": _peak_phase(f),
        "pattern": "early hyperenhancement" if f.arterial_hyperenhancement else "progressive enhancement",
        "homogeneity": "heterogeneous" if _heterogeneous(f) else "homogeneous",
        "t": text.t,
        "n": text.n,
        "m": text.m,
        "group": text.group or "0",
        "early_advanced": _stage_words(text.t)[0],
        "location": f.tumour_location,
        "curvature": CURVATURE_EN[f.tumour_curvature],
        "third": THIRD[f.tumour_location],
        "metastasis_site": "liver" if f.n_liver_mets else "none",
    }
    pool = [
        _Question(category, key, phrasings, answers[key])
        for category, questions in QUESTIONS.items()
        for key, phrasings in questions.items()
    ]
    other_location = str(rng.choice([x for x in TUMOUR_LOCATIONS if x != f.tumour_location]))
    other_curvature = str(rng.choice([c for c in CURVATURES if c != f.tumour_curvature]))
    facts: list[tuple[str, Pair, bool]] = [
        (
            f"in_{x}",
            (f"Is the tumour located in the {LOCATION_EN[x]}?", f"肿瘤是否位于{LOCATION_ZH[x]}？"),
            x == f.tumour_location,
        )
        for x in (f.tumour_location, other_location)
    ]
    facts += [
        (
            f"on_{c}",
            (f"Does the lesion involve the {CURVATURE_EN[c]}?", f"病灶是否累及{CURVATURE_ZH[c]}？"),
            c == f.tumour_curvature,
        )
        for c in (f.tumour_curvature, other_curvature)
    ]
    facts += [
        (
            "arterial",
            ("Does the lesion enhance markedly in the arterial phase?", "病灶动脉期是否明显强化？"),
            f.arterial_hyperenhancement,
        ),
        ("nodes", ("Are enlarged perigastric lymph nodes seen?", "胃周是否见肿大淋巴结？"), f.n_nodes > 0),
        ("liver", ("Are there liver metastases?", "是否有肝转移？"), f.n_liver_mets > 0),
        ("ascites", ("Is ascites present?", "是否有腹水？"), f.ascites),
        ("serosa", ("Is the serosa invaded?", "浆膜是否受侵？"), imaging_t in ("T4a", "T4b")),
        (
            "fat",
            ("Is the perigastric fat infiltrated?", "胃周脂肪间隙是否受侵？"),
            imaging_t in ("T3", "T4a", "T4b"),
        ),
        ("ulcer", ("Is the lesion ulcerated?", "病灶是否有溃疡形成？"), f.gross_type in ULCERATED_GROSS_TYPES),
        ("large", ("Is the lesion longer than 40 mm?", "病灶长径是否大于40mm？"), f.tumour_size_mm > 40),
        (
            "advanced",
            ("Does the diagnostic conclusion indicate advanced gastric cancer?", "诊断结论是否提示进展期胃癌？"),
            text.t not in EARLY_T,
        ),
        (
            "nodal_metastasis",
            ("Does the diagnosis suggest regional lymph node metastasis?", "诊断是否提示区域淋巴结转移？"),
            text.n != "N0",
        ),
        (
            "distant_metastasis",
            ("Does the diagnosis suggest distant metastasis?", "诊断是否提示远处转移？"),
            text.m == "M1",
        ),
    ]
    pool += [_Question("yes_no", key, (pair,), "yes" if truth else "no") for key, pair, truth in facts]
    return pool
