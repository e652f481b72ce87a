"""Run reports and the live console."""
