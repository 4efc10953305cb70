"""What `help()` shows of the names `elmo_pipeline` exports, and of the transforms: every public
method of theirs (ours, not torch's, pydantic's or Beam's) says what it does, by its parameters'
names."""

from __future__ import annotations

import importlib
import inspect
import pydoc
import re

import elmo_pipeline
import elmo_pipeline.downstream


def _our_methods(cls: type) -> dict[str, object]:
    """Public methods, properties and the constructor that `cls` gets from a class of ours."""
    found: dict[str, object] = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("elmo_pipeline"):
            continue
        for name, raw in vars(klass).items():
            if name in found or (name.startswith("_") and name != "__init__"):
                continue
            function = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
            function = function.fget if isinstance(function, property) else function
            if hasattr(function, "__code__"):  # not a field, a constant or a generated method
                found[name] = function
    return found


def _unexplained(names: list[object]) -> list[str]:
    """Of exported classes and functions, each without a doc, and each method or function whose doc
    leaves out one of its parameters (a constructor's: in its class's doc)."""
    found = []
    for obj in names:
        functions = _our_methods(obj) if inspect.isclass(obj) else {"": obj}
        if inspect.isclass(obj) and not (obj.__doc__ or "").strip():
            found.append(f"{obj.__name__}: no doc")
        for name, function in functions.items():
            doc = obj.__doc__ if name in ("__init__", "") else function.__doc__
            where = f"{obj.__name__}.{name}".rstrip(".")
            if not (doc or "").strip():
                found.append(f"{where}: no doc")
                continue
            parameters = [p.name for p in inspect.signature(function).parameters.values()
                          if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            missing = [p for p in parameters if not re.search(rf"\b{p}\b", doc)]
            if missing:
                found.append(f"{where}: {missing}")
    return found


def test_every_public_method_of_the_exported_names_says_what_it_does_naming_its_parameters():
    """ScalarMix.forward showed torch's "Define the computation performed at every call",
    ElmoConfig.from_options the comment above it ("# -- the original options.json"), and
    save_pretrained, CarriedState.embed, MixSpec.preset and ten more nothing; from_pretrained and
    load never named `location`, nor BiLM's doc `cache_size` or `kernel`."""
    classes = [getattr(elmo_pipeline, name) for name in elmo_pipeline.__all__
               if inspect.isclass(getattr(elmo_pipeline, name))]
    assert {c.__name__ for c in classes} == {"BiLM", "CarriedState", "ElmoConfig", "Embeddings", "MixSpec",
                                             "ScalarMix"}
    assert _unexplained(classes) == []


def test_every_name_the_downstream_package_exports_says_what_it_does_naming_its_parameters():
    """The first test covered the package's root only: TrainableMix's penalty, gamma, to_spec and
    n_layers, ElmoConcat's forward and penalty, FeatureBatch.to and ParquetFeatureDataset.epoch had
    no doc, ParquetFeatureDataset's named neither sources, seed, with_tokens, rank nor world_size,
    and concat_elmo's neither x nor elmo."""
    exported = [getattr(elmo_pipeline.downstream, name) for name in elmo_pipeline.downstream.__all__]
    assert {e.__name__ for e in exported} == {"ElmoConcat", "FeatureBatch", "ParquetFeatureDataset", "TrainableMix",
                                              "concat_elmo"}
    assert _unexplained(exported) == []


def test_help_on_the_model_shows_how_to_load_and_embed():
    text = pydoc.render_doc(elmo_pipeline.BiLM, renderer=pydoc.plaintext)
    for entry in ("from_pretrained", "from_allennlp", "from_formanylangs", "embed", "save_pretrained"):
        assert re.search(rf"`{entry}`", text.split("Method resolution order")[0]), entry


def test_every_transform_names_its_options_in_its_doc_and_every_function_has_one():
    """EmbedSentences' doc never named model, device, precision, kernel, cache_size or
    large_model, WriteParquet's output, num_shards or row_group_mb, ReadDocuments' input_format,
    text_field or id_field, and error_line had none; a class without an __init__ of its own was
    passed over, so TokenizedText showed only the doc a NamedTuple makes of its fields."""
    unnamed = []
    for module_name in ("read", "tokenize", "embed", "mix", "write", "pretokenized"):
        module = importlib.import_module(f"elmo_pipeline.transforms.{module_name}")
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            init = vars(obj).get("__init__") if inspect.isclass(obj) else None
            function = init if init is not None and hasattr(init, "__code__") else obj
            if inspect.isclass(function):  # no __init__ of its own (a NamedTuple's fields, Beam's label)
                if not (obj.__doc__ or "").strip() or re.fullmatch(rf"{name}\(.*\)", obj.__doc__):  # generated
                    unnamed.append(f"{module_name}.{name}: no doc")
                continue
            if not inspect.isfunction(function):
                continue
            doc = (obj.__doc__ or "") + (function.__doc__ or "" if function is not obj else "")
            # a transform's options by name; a helper function, a doc of its own
            parameters = [p.name for p in inspect.signature(function).parameters.values()
                          if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)] if init else []
            missing = [p for p in parameters if not re.search(rf"\b{p}\b", doc)]
            if missing or not doc.strip():
                unnamed.append(f"{module_name}.{name}: {missing or 'no doc'}")
    assert unnamed == []
