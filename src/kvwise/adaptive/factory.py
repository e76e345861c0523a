"""The one way to build the adaptive controller, for `LLM(kv="auto")` and `kvwise serve`.

Registered with the engine as "auto" (`engine.controllers`), which is how the offline API reaches
it without importing this layer.
"""

from __future__ import annotations

import logging

from kvwise.adaptive.controller import AdaptiveConfig, AdaptiveController
from kvwise.adaptive.profile import require_profile
from kvwise.engine.controllers import register_controller

log = logging.getLogger(__name__)


def build_adaptive_controller(
    model,
    *,
    quality: float | None = None,
    config: AdaptiveConfig | None = None,
    profile_path: str | None = None,
    tokenizer=None,
    calibrate_on_start: bool = False,
) -> AdaptiveController:
    """The controller on `model`'s calibration profile (the file at `profile_path`, else the
    user's, then the shipped one), with `config`, or the defaults and the quality floor `quality`
    (a share of the full cache's quality per request class). Without a profile,
    `calibrate_on_start` makes one first (quick calibration, needs `tokenizer`); otherwise the
    ValueError names `kvwise calibrate`."""
    try:
        profile = require_profile(model, profile_path)
    except ValueError:
        if not calibrate_on_start or profile_path is not None:
            raise
        from kvwise.adaptive.calibrate import CalibrateConfig, run_calibrate

        log.warning("no KV profile for this model: calibrating (--quick) before serving")
        run_calibrate(CalibrateConfig(quick=True), model=(model, tokenizer))
        profile = require_profile(model)
    if config is None:
        config = AdaptiveConfig() if quality is None else AdaptiveConfig(quality)
    elif quality is not None:
        raise ValueError("give the quality floor in config or as quality, not both")
    return AdaptiveController(profile, config)


register_controller("auto", build_adaptive_controller)
