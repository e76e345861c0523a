"""matplotlib for report plots, headless, or None (with a warning) when the [bench] extra is missing."""

from __future__ import annotations

import logging

log = logging.getLogger("kvwise")


def headless_pyplot(what: str):
    """`matplotlib.pyplot` on the Agg backend, or None after warning that `what` is not drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no %s (pip install 'kvwise[bench]')", what)
        return None
    return plt
