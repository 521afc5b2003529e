"""The thin Ray actors over the engine: a DP rank, an expert rank (both gang members: rank identity,
device setup, rendezvous and the step loop) and a KV store. They know nothing of the control plane
(`rackserve.cluster`) that starts and watches them."""
