"""Vault / OpenBao transit backend and its client."""
