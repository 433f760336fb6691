"""Index streams: which observations each batch holds.

``sampling``: the predecessor-exact streams of ``spec/SAMPLING.md``;
``counter_streams``: counter-based streams, a batch a pure function of
(seed, position) in O(1) memory, with ``counter_chains`` drawing them for
many chains at once on the host and ``device_streams`` in ``jax.numpy``.
"""
