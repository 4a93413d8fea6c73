"""This repository's top-level ``kernels`` package shares its import name with Hugging Face's
``kernels`` distribution, which transformers imports by that name when it is installed (a hard
dependency from transformers 5.25, hence the pin in pyproject.toml). The environment must not hold
that distribution, or every ``import transformers`` of a model breaks on ours."""

import importlib.metadata

import pytest

import kernels


def test_no_hugging_face_kernels_distribution_is_installed_to_be_shadowed() -> None:
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("kernels")
    assert kernels.__file__ is not None and "site-packages" not in kernels.__file__


def test_transformers_model_loading_imports_beside_this_kernels_package() -> None:
    from transformers.integrations import hub_kernels  # the module that imports HF's kernels by name
    from transformers.modeling_utils import PreTrainedModel

    assert hub_kernels is not None and PreTrainedModel is not None
