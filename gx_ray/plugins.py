"""Classes from outside gx-ray, named by a ``module:Class`` reference or by an entry point of a group, checked
against a protocol as they load: one error names the reference and everything the class lacks. Tasks
(:func:`gx_ray.tasks.task_class`) and vision-language models (:func:`gx_ray.models.vlm.vlm_class`) plug in this way."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any


def entry_points_named(group: str, name: str) -> list[EntryPoint]:
    """The entry points of ``group`` called ``name``, one per value."""
    # a distribution on sys.path twice lists its entry points twice: the same value is one entry point
    return list({ep.value: ep for ep in entry_points(group=group) if ep.name == name}.values())


def load_class(
    reference: str, where: str, problems: Callable[[Any], list[str]], protocol: str, error: type[ValueError]
) -> Any:
    """The class ``module:Qual.Name`` points to, checked by ``problems`` (what it lacks of ``protocol``; empty: all
    there); raises ``error`` naming ``where`` the reference came from, and everything missing."""
    module_name, _, attribute = reference.strip().partition(":")
    if not module_name or not attribute:
        raise error(f"{where} is not 'module:Class'")
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as err:  # a plug-in module may fail any way: what matters is which reference and why
        raise error(f"{where}: module {module_name!r} does not import ({type(err).__name__}: {err})") from err
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise error(f"{where}: module {module_name!r} has no {attribute!r}")
        found = getattr(found, part)
    lacking = problems(found)
    if lacking:
        raise error(f"{where} does not implement the {protocol} protocol: {'; '.join(lacking)}")
    return found
