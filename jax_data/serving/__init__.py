"""The host side of the callback: NumPy only, no JAX.

A pipeline's ``Host`` (``host``) serves the lanes of a request and copies
them into compiled code's buffers; its ``ChainStore`` (``chunk_store``)
answers "chunk k of chain c" from the chunks it keeps (``chain_records``)
or by having them produced (``production``), and schedules the next ones
on the prefetch thread (``prefetch``); devices of one refresh meet in
``rendezvous``. Chunks come from the loaders: ``jax_data.loaders``.
"""
