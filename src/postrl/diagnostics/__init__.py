"""Diagnostics: per-step metrics, monitors with threshold alarms, the sharpness probe, the reward probe and the
doctor (METHODS.md section 7; docs/metrics.md lists every metric and alarm)."""

from postrl.config.diagnostics import DiagnosticsConfig, LoggingConfig
from postrl.diagnostics.monitors import MONITORS, Alarm, Watchdog, replay

__all__ = ["MONITORS", "Alarm", "DiagnosticsConfig", "LoggingConfig", "Watchdog", "replay"]
