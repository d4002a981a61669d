"""The dashboard tab: pyqtgraph plots of the telemetry stream (no OpenGL, no antialiasing).

Every series is one persistent PlotDataItem fed with `setData` from ring-buffer views; the
heatmap is an ImageItem with fixed levels and a 256-entry LUT. Snapshots are ingested as
they arrive (5/s from the server while generating) and the plots redraw on a 10 Hz timer only
when something changed, so a burst of snapshots never queues redraws.
"""
from __future__ import annotations

import html
import time
from collections import deque

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, Qt, QTimer
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QGraphicsItem, QGridLayout, QLabel, QVBoxLayout, QWidget

from app.dashboard.series import StatsSeries, over_pcie, residency_lut

pg.setConfigOptions(antialias=False, useOpenGL=False)

# Which panels each mode shows, as (panel, row, column, row span, column span).
LAYOUTS = {
    "gpu": (("decode", 0, 0, 1, 1), ("prefill", 0, 1, 1, 1), ("hits", 0, 2, 1, 1),
            ("heat", 1, 0, 1, 2), ("bars", 1, 2, 1, 1),
            ("memory", 2, 0, 1, 1), ("cpu", 2, 1, 1, 1), ("pcie", 2, 2, 1, 1)),
    "cpu": (("decode", 0, 0, 1, 1), ("prefill", 0, 1, 1, 1), ("cpu", 0, 2, 1, 1),
            ("heat", 1, 0, 1, 2), ("memory", 1, 2, 1, 1)),
    "no_cache": (("decode", 0, 0, 1, 1), ("prefill", 0, 1, 1, 1),
                 ("memory", 1, 0, 1, 1), ("cpu", 1, 1, 1, 1)),
}
MODE_NOTES = {
    "gpu": "",
    "cpu": ("<b>CPU only:</b> no GPU is in use, so every expert is computed on the CPU from RAM. GPU hits, "
            "PCIe uploads and resident experts do not exist here, so they are not drawn; the map shows which "
            "experts the recent tokens used."),
    "no_cache": ("<b>llama.cpp engine:</b> it runs the experts itself, so expert hits, uploads and residency are "
                 "not measured (zeros would pretend to be measurements). The hybrid engine (Settings) shows them "
                 "on a machine with an NVIDIA GPU."),
}
HEAT_TITLES = {"gpu": "Expert residency (amber: on the GPU, blue: in RAM; brighter: hotter)",
               "cpu": "Expert heat (brighter: used more by recent tokens)"}
HOVER_HINTS = {"gpu": "Hover over the map for an expert's layer, slot and recent hits.",
               "cpu": "Hover over the map for an expert's layer and recent hits."}
COLORS = {"decode": (80, 160, 255), "prefill": (255, 170, 60), "gpu_hit": (90, 200, 120),
          "uploaded": (240, 190, 60), "cpu": (220, 90, 90), "pcie": (170, 120, 255), "ram": (80, 160, 255),
          "vram": (90, 200, 120), "cpuuse": (220, 90, 90), "bars": (90, 200, 120)}


WINDOW_S = 120.0  # the time plots show the last two minutes


def _plot(title: str, left: str, bottom: str = "seconds ago", time_axis: bool = True,
          legend: bool = False) -> pg.PlotWidget:
    w = pg.PlotWidget()
    if time_axis:
        # A fixed x range in "seconds ago": the axes stay the same between updates, so pyqtgraph
        # keeps their rendered pictures instead of re-rendering every label 5 times a second
        # (axis text was 70% of the dashboard's paint time with a sliding absolute time axis).
        w.setXRange(-WINDOW_S, 0, padding=0)
        w.enableAutoRange(x=False)
    w.setTitle(title)
    w.setLabel("left", left)
    if bottom:
        w.setLabel("bottom", bottom)
    w.showGrid(x=False, y=True, alpha=0.15)
    for axis in ("left", "bottom"):
        ax = w.getAxis(axis)
        ax.enableAutoSIPrefix(False)  # "GiB (x0.001)" helps nobody
        # Keep each axis as a pixmap between changes: replaying its text on every repaint was
        # most of the dashboard's paint time.
        ax.setCacheMode(QGraphicsItem.DeviceCoordinateCache)
    w.setMouseEnabled(x=False, y=False)
    w.setMenuEnabled(False)
    w.hideButtons()
    if legend:  # only where curves share a plot: a one-curve plot's title already names it
        w.addLegend(offset=(5, 5), labelTextSize="8pt")
    return w


def _curve(plot: pg.PlotWidget, name: str, color, **kw) -> pg.PlotDataItem:
    c = plot.plot([], [], name=name, pen=pg.mkPen(color, width=2), connect="finite", **kw)
    c.setClipToView(True)
    c.setDownsampling(auto=True, method="peak")
    return c


def dashboard_mode(snap: dict) -> str:
    """"no_cache" (llama.cpp runs the experts), "cpu" (the hybrid engine without a GPU) or "gpu"."""
    if snap.get("cache") is None:
        return "no_cache"
    return "cpu" if snap.get("gpu_memory_used_bytes") is None else "gpu"


class DashboardWidget(QWidget):
    REDRAW_MS = 100

    def __init__(self, parent: QWidget | None = None, capacity: int = 1200):
        super().__init__(parent)
        self.series = StatsSeries(capacity)
        self._dirty = False
        self._arrivals: deque[float] = deque(maxlen=64)
        self.redraws = 0
        self.mode = ""

        self.header = QLabel("Waiting for the engine\u2026")
        self.header.setWordWrap(True)
        self.header.setTextFormat(Qt.RichText)
        self.rate_label = QLabel()
        self.rate_label.setAlignment(Qt.AlignRight | Qt.AlignVCenter)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.summary.setTextFormat(Qt.RichText)
        self.mode_note = QLabel()
        self.mode_note.setWordWrap(True)
        self.mode_note.setObjectName("dashboardModeNote")
        # Why llama.cpp runs (the server's engine_reason, e.g. auto on a machine without CUDA):
        # shown in the llama.cpp layout, whose panels only make sense with it.
        self.engine_reason = ""
        self.why_note = QLabel()
        self.why_note.setWordWrap(True)
        self.why_note.setTextFormat(Qt.RichText)
        self.why_note.setObjectName("dashboardWhyEngine")
        self.why_note.setVisible(False)

        # Decode (tens of tok/s) and prefill (thousands) on one axis made decode a flat line at
        # the bottom: each has its own plot and axis.
        self.decode_plot = _plot("Decode tok/s", "tok/s")
        self.decode_curve = _curve(self.decode_plot, "decode", COLORS["decode"])
        self.prefill_plot = _plot("Prefill tok/s (one point per request)", "tok/s")
        self.prefill_curve = self.prefill_plot.plot([], [], name="prefill", pen=None, symbol="o",
                                                    symbolSize=6, symbolBrush=COLORS["prefill"])

        self.hit_plot = _plot("Experts served (share)", "%", legend=True)
        self.hit_plot.setYRange(0, 100)
        self.hit_curves = [_curve(self.hit_plot, "GPU hit", COLORS["gpu_hit"]),
                           _curve(self.hit_plot, "over PCIe", COLORS["uploaded"]),
                           _curve(self.hit_plot, "CPU", COLORS["cpu"])]

        self.pcie_plot = _plot("PCIe uploads", "MB/s")
        self.pcie_curve = _curve(self.pcie_plot, "expert uploads", COLORS["pcie"])

        self.heat_plot = pg.PlotWidget()
        self.heat_plot.setTitle(HEAT_TITLES["gpu"])
        self.heat_plot.setLabel("left", "layer")
        self.heat_plot.setLabel("bottom", "expert")
        self.heat_plot.getAxis("left").enableAutoSIPrefix(False)
        self.heat_plot.setMouseEnabled(x=False, y=False)
        self.heat_plot.setMenuEnabled(False)
        self.heat_plot.hideButtons()
        self.heat_plot.getViewBox().invertY(True)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.image.setLookupTable(residency_lut())
        self.image.setLevels((0, 255))
        self.heat_plot.addItem(self.image)
        self.hover_label = QLabel(HOVER_HINTS["gpu"])
        self.heat_plot.scene().sigMouseMoved.connect(self._hover)

        self.bar_plot = _plot("Hit rate per layer", "%", "layer", time_axis=False)
        self.bar_plot.setYRange(0, 100)
        self.bars = pg.BarGraphItem(x=np.zeros(0), height=np.zeros(0), width=0.8, brush=COLORS["bars"])
        self.bar_plot.addItem(self.bars)
        self.bar_note = pg.TextItem("", anchor=(0.5, 0.5))
        self.bar_plot.addItem(self.bar_note)

        self.mem_plot = _plot("Memory", "GiB", legend=True)
        self.ram_curve = _curve(self.mem_plot, "RAM (engine)", COLORS["ram"])
        self.vram_curve = _curve(self.mem_plot, "VRAM", COLORS["vram"])
        self.cpu_plot = _plot("CPU (engine)", "% of one core")
        self.cpu_curve = _curve(self.cpu_plot, "CPU", COLORS["cpuuse"])

        heat_box = QWidget()
        hb = QVBoxLayout(heat_box)
        hb.setContentsMargins(0, 0, 0, 0)
        hb.addWidget(self.heat_plot, 1)
        hb.addWidget(self.hover_label)
        self.panels: dict[str, QWidget] = {
            "decode": self.decode_plot, "prefill": self.prefill_plot, "hits": self.hit_plot, "heat": heat_box,
            "bars": self.bar_plot, "memory": self.mem_plot, "cpu": self.cpu_plot, "pcie": self.pcie_plot}

        self.grid = QGridLayout()
        top = QVBoxLayout(self)
        head = QGridLayout()
        head.addWidget(self.header, 0, 0)
        head.addWidget(self.rate_label, 0, 1)
        head.setColumnStretch(0, 1)
        top.addLayout(head)
        top.addWidget(self.summary)
        top.addWidget(self.mode_note)
        top.addWidget(self.why_note)
        top.addLayout(self.grid, 1)
        self.set_mode("gpu")
        self.apply_palette()

        self._timer = QTimer(self)
        self._timer.setInterval(self.REDRAW_MS)
        self._timer.timeout.connect(self.redraw)
        self._timer.start()

    def set_mode(self, mode: str) -> None:
        """Lays out the panels that mean something for this engine and machine, and says why the others are absent."""
        if mode == self.mode:
            return
        self.mode = mode
        for panel in self.panels.values():
            self.grid.removeWidget(panel)
            panel.setVisible(False)
        for row in range(3):
            self.grid.setRowStretch(row, 0)
        for name, row, col, rows, cols in LAYOUTS[mode]:
            self.grid.addWidget(self.panels[name], row, col, rows, cols)
            self.panels[name].setVisible(True)
            self.grid.setRowStretch(row, 1)
        self.mode_note.setText(MODE_NOTES[mode])
        self.mode_note.setVisible(bool(MODE_NOTES[mode]))
        self._show_why()
        if mode in HEAT_TITLES:
            self.heat_plot.setTitle(HEAT_TITLES[mode])
            self.hover_label.setText(HOVER_HINTS[mode])
            self.apply_palette()
        legend = self.mem_plot.getPlotItem().legend
        legend.removeItem(self.vram_curve)
        if mode == "gpu":
            legend.addItem(self.vram_curve, "VRAM")
        self.vram_curve.setVisible(mode == "gpu")

    def set_engine_reason(self, reason: str | None) -> None:
        """The engine's reason for running (from /health), told in the llama.cpp layout."""
        self.engine_reason = reason or ""
        self._show_why()

    def _show_why(self) -> None:
        text = html.escape(self.engine_reason)
        self.why_note.setText(f"<b>Why llama.cpp:</b> {text}" if text else "")
        self.why_note.setVisible(self.mode == "no_cache" and bool(text))

    def visible_plots(self) -> list[pg.PlotWidget]:
        return [p for p in (self.decode_plot, self.prefill_plot, self.hit_plot, self.pcie_plot, self.heat_plot,
                            self.bar_plot, self.mem_plot, self.cpu_plot) if p.isVisibleTo(self)]

    # ---- data in ----------------------------------------------------------------------------
    def ingest(self, snap: dict) -> None:
        self._arrivals.append(time.monotonic())
        self.series.ingest(snap)
        self._dirty = True

    def update_rate(self) -> float:
        """Snapshots per second received over the last few seconds."""
        a = self._arrivals
        if len(a) < 2 or time.monotonic() - a[-1] > 2.5:
            return 0.0
        recent = [t for t in a if a[-1] - t <= 3.0]
        return (len(recent) - 1) / (recent[-1] - recent[0]) if len(recent) > 1 and recent[-1] > recent[0] else 0.0

    def engine_changed(self) -> None:
        """A new engine process: its counters start from zero."""
        self.series.reset_counters()

    # ---- drawing --------------------------------------------------------------------------------
    def redraw(self) -> None:
        if not self._dirty or not self.isVisible():
            return  # another tab is showing: keep ingesting, draw when the dashboard is looked at
        self.rate_label.setText(f"stats stream: {self.update_rate():.1f} snapshots/s")
        self._dirty = False
        self.redraws += 1
        s = self.series
        now = s.latest_t

        def ago(view):  # (t, y) ring-buffer views -> (seconds ago, y)
            t, y = view
            return t - now, y
        self.decode_curve.setData(*ago(s.tokens.view()))
        self.prefill_curve.setData(*ago(s.prefill.view()))
        self.ram_curve.setData(*ago(s.memory.view(0)))
        self.vram_curve.setData(*ago(s.memory.view(1)))
        self.cpu_curve.setData(*ago(s.cpu.view()))
        if s.last is not None:
            self.set_mode(dashboard_mode(s.last))
        if s.has_cache:
            for i, curve in enumerate(self.hit_curves):
                curve.setData(*ago(s.hits.view(i)))
            self.pcie_curve.setData(*ago(s.pcie.view()))
            if s.image.size:
                self.image.setImage(s.image, autoLevels=False, levels=(0, 255))
                self.image.setRect(-0.5, -0.5, s.image.shape[1], s.image.shape[0])
            x = np.arange(len(s.layers), dtype=float)
            self.bars.setOpts(x=x, height=s.layer_hit_rate, width=0.8)
            self.bar_plot.getAxis("bottom").setTicks([[(i, str(layer)) for i, layer in enumerate(s.layers)]])
            slots = (s.last or {}).get("cache", {}).get("slots_per_layer")
            self.bar_note.setText("no resident experts\n(0 slots per layer)" if slots == 0 else "")
            self.bar_note.setPos((len(s.layers) - 1) / 2, 50)
            self.heat_plot.getAxis("left").setTicks([[(i, str(layer)) for i, layer in enumerate(s.layers)]])
        self._update_text()

    def _update_text(self) -> None:
        snap = self.series.last
        if not snap:
            return
        last = snap.get("last_request") or {}
        parts = [f"<b>{snap.get('model', '?')}</b> on the <b>{snap.get('engine', '?')}</b> engine",
                 f"{snap.get('requests', 0)} requests, {snap.get('completion_tokens', 0)} tokens generated"]
        if last:
            parts += [f"last request: TTFT {last.get('ttft_s', 0) * 1000:.0f} ms",
                      f"prefill {last.get('prefill_tokens_per_s', 0):.1f} tok/s",
                      f"decode {last.get('decode_tokens_per_s', 0):.1f} tok/s"]
        self.header.setText(" \u00b7 ".join(_unbroken(p) for p in parts))
        cache = snap.get("cache")
        lines = []  # shown as one line, " · " apart
        ram, vram = snap.get("ram_used_bytes"), snap.get("gpu_memory_used_bytes")
        lines.append(f"RAM {ram / (1 << 30):.2f} GiB" if ram else "RAM n/a")
        if vram is not None:
            lines.append(f"VRAM {vram / (1 << 30):.2f} GiB")
        if snap.get("cpu_percent") is not None:
            lines.append(f"CPU {snap['cpu_percent']:.0f}%")
        if cache and dashboard_mode(snap) == "cpu":  # no slots, hits or uploads to speak of
            lines.append(f"CPU expert pool busy {cache['cpu_busy_s']:.2f} s")
        elif cache:
            total = sum(cache["gpu_hit"]) + over_pcie(cache).sum() + sum(cache["cpu_computed"])
            hit = sum(cache["gpu_hit"]) / total * 100 if total else 0.0
            lines.append(f"{cache['slots_per_layer']} of {cache['n_expert']} experts resident per layer")
            lines.append(f"hit rate since start {hit:.1f}%")
            lines.append(f"swaps {sum(cache['swaps'])}, uploaded {cache['bytes_uploaded'] / 1e6:.1f} MB")
            if sum(cache.get("gpu_mapped", [])):
                lines.append(f"misses the GPU read from pinned RAM {sum(cache['gpu_mapped'])}")
            lines.append(f"CPU expert pool busy {cache['cpu_busy_s']:.2f} s")
            if "miss_fraction" in cache:  # engines from before these fields existed do not send them
                how = " (measured)" if cache.get("miss_fraction_tuning") else ""
                lines.append(f"misses uploaded {cache['miss_fraction']:.0%}{how}; experts read from "
                             f"{'pinned RAM' if cache.get('load_mode') == 'none' else 'the mapped file'}")
            steps = cache.get("prompt_steps")
            if steps and any(steps.values()):
                lines.append("prompt layer steps " + ", ".join(f"{route} {n}" for route, n in steps.items()))
            if cache.get("prompt_graph_chunks"):
                lines.append(f"prompt chunks as CUDA graphs {cache['prompt_graph_chunks']}")
            for kind, form in (cache.get("decode_expert_step") or {}).items():
                lines.append(f"decode expert step {kind}: {_step_form(form)}")
        self.summary.setText(" \u00b7 ".join(_unbroken(line) for line in lines))

    def _hover(self, pos: QPointF) -> None:
        s = self.series
        if not s.image.size:
            return
        p = self.image.mapFromScene(pos)
        col, row = int(np.floor(p.x() + 0.5)), int(np.floor(p.y() + 0.5))
        if not (0 <= row < s.image.shape[0] and 0 <= col < s.image.shape[1]):
            return
        text = describe_expert(s, row, col)
        self.hover_label.setText(text)
        self.heat_plot.setToolTip(text)

    def apply_palette(self) -> None:
        """Plots follow the system theme (light or dark)."""
        pal = self.palette()
        bg, fg = pal.color(QPalette.Base), pal.color(QPalette.Text)
        for w in (self.decode_plot, self.prefill_plot, self.hit_plot, self.pcie_plot, self.heat_plot, self.bar_plot,
                  self.mem_plot, self.cpu_plot):
            w.setBackground(bg)
            for axis in ("left", "bottom"):
                ax = w.getAxis(axis)
                ax.setPen(fg)
                ax.setTextPen(fg)
            w.getPlotItem().titleLabel.setAttr("color", fg.name())
            w.getPlotItem().titleLabel.setText(w.getPlotItem().titleLabel.text)
            legend = w.getPlotItem().legend
            if legend is not None:
                legend.setLabelTextColor(fg)
                legend.setBrush(pg.mkBrush(bg.red(), bg.green(), bg.blue(), 200))


def _step_form(form: dict) -> str:
    """A decode_expert_step entry (engine/moe/step_form.StepForm) in words."""
    how = "one launch" if form["one_launch"] else "three launches"
    if form.get("one_launch_us") is None or form.get("three_launches_us") is None:
        return how
    return f"{how} (timed {form['one_launch_us']:.1f} against {form['three_launches_us']:.1f} \u00b5s)"


def _unbroken(part: str) -> str:
    """Rich text that wraps between the header's parts, never inside one ("tok/" | "s")."""
    return f'<span style="white-space:nowrap">{part}</span>'


def describe_expert(s: StatsSeries, row: int, col: int) -> str:
    slot = int(s.residency[row, col])
    where = f"resident in slot {slot}" if slot >= 0 else "in RAM (not resident)"
    return (f"layer {s.layers[row]}, expert {col}: {where}; recent hits {float(s.heat[row, col]):.1f} "
            "(decayed count over the last ~50 tokens)")
