"""Calibration of reward-model scores into P(success): temperature scaling, isotonic regression (PAV) and
conditional optimal transport (a monotone conditional quantile model of the success probability given the score,
the condition and optional PRM features, with confidence bounds at any level), with ECE / Brier / reliability
diagrams.

``postrl calibrate`` fits one on a file of (score, condition, outcome) rows, prints ECE and Brier before and
after, saves the calibrator as JSON and writes a reliability diagram; the ``model`` reward source applies a saved
calibrator at reward time (``calibrator: path.json``). :mod:`postrl.calibration.ias` turns a calibrated
success bound into an instance-adaptive Best-of-N budget (``postrl eval --ias``).
"""

from postrl.calibration.calibrators import (  # noqa: F401
    METHODS,
    Calibrator,
    ConditionalOT,
    Isotonic,
    TemperatureScaling,
    load_calibrator,
    make_calibrator,
    pav,
    to_prob,
)
from postrl.calibration.metrics import brier, conditional_ece, ece, reliability_curve, reliability_diagram  # noqa: F401
from postrl.calibration.ias import ias_samples, success_bound  # noqa: F401


def step_bucket(step_index: int, max_bucket: int = 4) -> str:
    """Condition label of a PRM step: ``str(min(step_index, max_bucket))`` (steps counted from 0; default 4)."""
    return str(min(int(step_index), int(max_bucket)))
