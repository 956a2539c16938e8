"""The ``example_zero`` config section (torch-free): the stage's own knob, with its default, once."""

from __future__ import annotations

from dscore.config.base import PositiveInt, SectionModel


class ExampleZeroConfig(SectionModel):
    """``example_zero``: how :class:`dscore_example_zero.stage.CountBucketStage2` cuts buckets."""

    params_per_bucket: PositiveInt = 2
    """Parameters per reduce bucket (in backward order), whatever their sizes."""
