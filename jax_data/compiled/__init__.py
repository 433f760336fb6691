"""The JAX side: what runs in and around ``jit``.

The constructors and their pipelines (``random_access``, ``full_access``
with ``pass_loop`` and ``pass_keys``, ``device_loader``), the pipeline
object and its states (``pipeline``, ``states``), ``jax_data.scan``
(``scan``), checkpoints (``checkpoint``), ``process_shard``
(``distributed``), and the bridge that turns a refresh into a host callback
(``bridge``). Below it, NumPy only: ``jax_data.serving``.
"""
