"""Fake: an optimum-habana release whose MPT module fails on an import of its own."""

from transformers.models.mpt.modeling_mpt import NoSuchNameInTransformers  # noqa: F401
