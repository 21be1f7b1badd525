"""The chunk store's exception types."""


class ChunkStoreError(ValueError):
    """A chunk or a chunk file that cannot be used (bad input, mismatched model, corrupt file,
    unwritable directory, memory budget too small)."""


class ForeignChunkError(ChunkStoreError):
    """A well-formed chunk file of another format version, model (fingerprint) or layout: not
    this store's, but not damaged either (the remote tier leaves it for the processes it is for)."""
