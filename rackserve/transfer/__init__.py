"""Transports between ranks: expert-parallel dispatch/combine (and, later, KV state over NIXL)."""
