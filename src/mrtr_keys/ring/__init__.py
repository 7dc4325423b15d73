"""The key ring and every change to it: model, rotation, scope, create, rewrap, apply (one CAS path)."""
