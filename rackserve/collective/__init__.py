"""Host collective: recursive-doubling all-reduce, all-gather, broadcast and barrier over TCP.

    from rackserve.collective import RendezvousServer, join
    with join(server_address, rank, world_size, secret, timeout=5.0) as comm:
        counts = comm.allreduce(np.array([n_tokens, idle], np.int32), "sum")

No Ray in here: a Ray actor passes the peer table around and builds a ``Communicator``.
"""

from rackserve.collective.communicator import Communicator
from rackserve.collective.errors import CollectiveError
from rackserve.collective.rendezvous import RendezvousServer, join, rendezvous
from rackserve.collective.wire import listen

__all__ = ["CollectiveError", "Communicator", "RendezvousServer", "join", "listen", "rendezvous"]
