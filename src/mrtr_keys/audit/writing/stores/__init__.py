"""Audit stores: the contract (`base`), SQLite, PostgreSQL, JSON lines, and choosing one by URL."""
