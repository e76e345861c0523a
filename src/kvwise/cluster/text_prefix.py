"""A text prefix tree router, the stand-in for Ray Serve LLM's `PrefixCacheAffinityRouter`
(which imports only with `ray[llm]`). It follows that router's documented algorithm: the prompt
text (or the messages' contents joined) is matched character by character against the text
already routed to each replica; with balanced load, the replica with the longest match takes the
request if the match covers at least `match_rate_threshold` of it, else the replica holding the
least text; with imbalanced load (a queue-length gap over `imbalanced_threshold`), power of two
choices decides. The text sent to a replica is inserted after routing.

It sees no tenant, no block boundary, no tier and no compressed variant: what Ray's router sees.
"""

from __future__ import annotations

from collections.abc import Iterable


class _Node:
    __slots__ = ("children", "replicas")

    def __init__(self):
        self.children: dict[str, _Node] = {}
        self.replicas: set[str] = set()


class TextPrefixTree:
    """Character trie, one path per routed text; each node knows the replicas that were sent it."""

    def __init__(self, max_chars: int = 4096):
        self.root, self.max_chars = _Node(), max_chars
        self.chars: dict[str, int] = {}  # replica -> characters inserted for it

    def insert(self, text: str, replica: str) -> None:
        node = self.root
        node.replicas.add(replica)
        for char in text[: self.max_chars]:
            node = node.children.setdefault(char, _Node())
            if replica not in node.replicas:
                node.replicas.add(replica)
                self.chars[replica] = self.chars.get(replica, 0) + 1

    def match(self, text: str, replicas: Iterable[str]) -> tuple[int, set[str]]:
        """(matched characters, replicas holding that longest match) among `replicas`."""
        allowed = set(replicas)
        node, depth, holders = self.root, 0, set()
        for char in text[: self.max_chars]:
            child = node.children.get(char)
            if child is None or not (child.replicas & allowed):
                break
            node, depth, holders = child, depth + 1, child.replicas & allowed
        return depth, holders

    def remove(self, replica: str) -> None:
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.replicas.discard(replica)
            stack.extend(node.children.values())
        self.chars.pop(replica, None)

    def smallest(self, replicas: Iterable[str]) -> list[str]:
        """The replicas holding the least text, least first."""
        return sorted(replicas, key=lambda replica: self.chars.get(replica, 0))
