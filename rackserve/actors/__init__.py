"""Thin Ray actors over the engine: rank identity, device setup, rendezvous and the step loop."""
