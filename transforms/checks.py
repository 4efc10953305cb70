"""Checks of a transform's options where the pipeline is built: a bad value caught in a worker
comes only after the reading, once per worker, and in the words of whatever it reached."""

from __future__ import annotations

from typing import Any

import apache_beam as beam


def check_collection(transform: str, applied_to: Any) -> None:
    """Raises TypeError naming `transform` when it is applied to anything but one PCollection: to
    the dict of ReadDocuments' or TokenizeWithSpacy's outputs (`["documents"]` left out) it failed
    inside Beam, on "'dict' object has no attribute 'pipeline'" (or 'windowing', 'element_type')."""
    if isinstance(applied_to, beam.PCollection):
        return
    if isinstance(applied_to, dict):
        names = ", ".join(repr(name) for name in applied_to)
        raise TypeError(f"{transform} is applied to one PCollection, got a dict of them ({names}): give it the "
                        "one it takes by its name, outputs[NAME]")
    several = "; Flatten several into one" if isinstance(applied_to, (tuple, list)) else ""
    raise TypeError(f"{transform} is applied to one PCollection, got a {type(applied_to).__name__} "
                    f"({applied_to!r:.80}){several}")


def check_root(transform: str, applied_to: Any) -> None:
    """Raises TypeError naming `transform`, a reader, when it is applied to anything but the
    pipeline: to a PCollection it failed on a bare AssertionError inside Beam's Create."""
    if not isinstance(applied_to, beam.pvalue.PBegin):
        raise TypeError(f"{transform} reads files: apply it to the pipeline (p | {transform}(...)), not to a "
                        f"{type(applied_to).__name__}")


def check_element(transform: str, element: Any, expected: type) -> None:
    """Raises TypeError naming `transform` for an element of its input that is not an `expected`.
    Each transform declares its input type, so Beam refuses a collection of a known other type
    when the pipeline is built; this is for those whose type it cannot know (a lambda's output),
    which failed deep in the worker on an attribute they lack ('str' object has no attribute ...)."""
    if not isinstance(element, expected):
        raise TypeError(f"{transform} takes {expected.__name__}s, got a {type(element).__name__} ({element!r:.80})")
