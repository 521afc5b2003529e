"""The one exception a collective call raises when the group cannot finish it."""

from __future__ import annotations


class CollectiveError(RuntimeError):
    """A collective call failed: a peer died, stalled, lied about the secret or called out of order.

    ``ranks`` names the member(s) blamed, so a supervisor can restart the right actor. The
    communicator that raised is unusable afterwards; build a new group.
    """

    def __init__(self, message: str, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)
