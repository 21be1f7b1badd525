"""ragattn's micro- and end-to-end benchmark suite (``python -m bench``)."""
