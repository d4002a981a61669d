"""The live dashboard: telemetry series (no Qt) and their pyqtgraph views."""
