"""The pipeline's error type (user-facing: ``dscore.pipe.PipelineError``, DeepSpeed raises plain errors).

Kept in the core next to :class:`~dscore.pipe.PipelineModule` so that code catching it imports nothing of
the pipeline engine plugin, which raises it.
"""

from __future__ import annotations

from dscore.errors import DscoreError

__all__ = ["PipelineError"]


class PipelineError(DscoreError, RuntimeError):
    """The pipeline cannot run as asked (a stage output that changed shape, a non-tensor output, a
    direct ``forward``/``backward``/``step`` call on the pipeline engine, ...)."""
