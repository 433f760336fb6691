"""The loaders and the seam they plug into.

The seam: ``loader`` (``DataLoader``), ``host_loader`` (``HostDataLoader``:
chains opened from specs), ``chains`` (the specs, chunk layouts and the
``ChainCursor`` a loader returns), ``legacy_loader`` (the predecessor's
API). The loaders: ``numpy_loader`` with ``indexed`` (index streams over a
row reader), ``file_rows`` and ``gather`` (reading rows); ``tensorflow_*``
(``tf.data``, imported on first use); ``source_*`` (random-access sources,
worker threads or processes). Their index streams: ``jax_data.streams``.
"""
