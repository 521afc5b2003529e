"""Transports between ranks: expert-parallel dispatch/combine (`ep`), and request state: the
`KVTransport` protocol (`transport`), over NIXL (`kv_agent`) or in one process (`local`), with the
notifications both carry (`messages`)."""
