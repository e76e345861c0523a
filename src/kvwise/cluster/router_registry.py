"""The routers living in this process, by deployment name, for the ingress (which lists replicas
and targets control calls through them).

Its own module, imported at call time: Ray Serve ships a router class to the process that uses
it by cloudpickle, and the copy's functions would otherwise write into a copied dict."""

from __future__ import annotations

ACTIVE_ROUTERS: dict[str, object] = {}
