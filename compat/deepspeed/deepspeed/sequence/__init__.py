"""``deepspeed.sequence``: DeepSpeed 0.19.8's sequence-parallel layers (:mod:`.layer`, ``fpdt_layer``, AutoSP).

dscore's sequence parallelism is Ulysses (:mod:`deepspeed.runtime.sequence_parallel.ulysses_sp`,
:mod:`dscore.parallel.ulysses`); the names here import and raise
:class:`deepspeed._not_provided.NotProvidedError` when used.
"""
