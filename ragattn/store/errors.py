"""The chunk store's one exception type."""


class ChunkStoreError(ValueError):
    """A chunk or a chunk file that cannot be used (bad input, mismatched model, corrupt file,
    unwritable directory, memory budget too small)."""
