"""Writing: fingerprints, the chain and its key, the store's switch to keyed links, the writers (in process and
the writer process) and the stores."""
