"""`python -m engine.plan.service`: the planner for the desktop app's wizard, one JSON request
per stdin line, one JSON answer per stdout line (app/plan_service.py drives it).

The app process never imports the engine (torch); this process imports the planner once (a
few seconds, while the user reads the hardware page) and then answers in milliseconds: the
hardware probe, a model's summary and engine choice, the plan for the wizard's settings (the
same `make_plan` that `moestudio plan --json` prints), and writing the demo model with progress.

Requests: {"id": N, "op": "probe"|"model_info"|"plan"|"demo", ...}; answers: {"id": N, "ok":
true, "result": ...} or {"id": N, "ok": false, "error": "one line"}, and {"id": N, "progress":
[done, total, name]} while the demo model is written. Id 0 announces "starting" and "ready".
"""
from __future__ import annotations

import json
import sys
import traceback
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, TextIO

Send = Callable[[dict[str, Any]], None]


class Planner:
    """The state one wizard session reuses: the probed hardware and each model's geometry."""

    def __init__(self) -> None:
        from engine.plan.geometry import read_geometry
        from engine.plan.probe import probe_hardware

        self._read_geometry, self._probe = read_geometry, probe_hardware
        self._hardware = None
        self._geometries: dict[str, Any] = {}
        self._engines: dict[tuple[str, str, str], tuple[str, str]] = {}
        self._fingerprints: dict[str, str] = {}

    def hardware(self):
        if self._hardware is None:
            self._hardware = self._probe()
        return self._hardware

    def geometry(self, path: str):
        if path not in self._geometries:
            self._geometries[path] = self._read_geometry(path)
        return self._geometries[path]

    def engine(self, path: str, requested: str = "auto", device: str = "auto") -> tuple[str, str]:
        """(kind, reason): the server's own choice (engine/server/loader.choose_engine) on this
        machine, so the wizard says what `moestudio serve` will run; a refusal raises UserError."""
        from engine.config import resolve_device
        from engine.server.loader import choose_engine

        key = (path, requested, resolve_device(device))
        if key not in self._engines:
            self._engines[key] = choose_engine(path, requested, key[2])
        return self._engines[key]

    def model_info(self, path: str) -> dict[str, Any]:
        from engine.gguf.check import open_model

        g = self.geometry(path)
        mf = open_model(path, require_moe=False)
        types = Counter(t.qtype.name for t in mf.tensors.values())
        expert_types = Counter(t.qtype.name for n, t in mf.tensors.items() if "_exps." in n)
        kind, reason = self.engine(path)
        return {"geometry": g.to_json(), "quant_types": dict(types.most_common()),
                "expert_quant_types": dict(expert_types.most_common()), "engine": kind, "engine_reason": reason}

    def plan(self, path: str, settings: dict[str, Any], assume_gpu_mib: int | None = None) -> dict[str, Any]:
        """`settings` are engine/config.Config fields, as the wizard will save them in the preset."""
        from engine.config import Config
        from engine.plan.planner import PlanOptions, make_plan
        from engine.plan.probe import GpuInfo

        hw = self.hardware()
        if assume_gpu_mib:
            hw = replace(hw, gpus=(GpuInfo(name=f"assumed GPU with {assume_gpu_mib} MiB",
                                           total_bytes=assume_gpu_mib << 20, free_bytes=assume_gpu_mib << 20),))
        from engine.gguf.fingerprint import file_fingerprint
        from engine.plan.measured import speed_inputs

        g = self.geometry(path)
        options = PlanOptions()
        cfg = Config(**settings)
        from engine.plan.cli import plan_device

        # The engine that would run on the machine planned (a probed or assumed GPU is a CUDA machine).
        kind, reason = self.engine(path, cfg.engine, plan_device(cfg.device, hw))
        if path not in self._fingerprints:
            self._fingerprints[path] = file_fingerprint(path)
        # The measured rates are read again at every plan: the engine may have run since the last.
        speed = speed_inputs(self._fingerprints[path], kind, hw.gpu is not None)
        return {**make_plan(hw, g, cfg, options, **speed).to_json(hw, g, options), "engine": kind,
                "engine_reason": reason}

    def answer(self, request: dict[str, Any], send: Send) -> Any:
        rid, op = request.get("id"), request.get("op")
        if op == "probe":
            return self.hardware().to_json()
        if op == "model_info":
            return self.model_info(request["model"])
        if op == "plan":
            return self.plan(request["model"], request.get("settings", {}), request.get("assume_gpu_mib"))
        if op == "demo":
            from engine.synth.demo import demo_model_path

            return str(demo_model_path(progress=lambda done, total, name: send({"id": rid,
                                                                                  "progress": [done, total, name]})))
        raise ValueError(f"unknown op {op!r}")


def serve(requests: TextIO, answers: TextIO) -> None:
    from engine.errors import UserError

    def send(obj: dict[str, Any]) -> None:
        answers.write(json.dumps(obj) + "\n")
        answers.flush()

    send({"id": 0, "ok": True, "result": "starting"})
    planner = Planner()
    send({"id": 0, "ok": True, "result": "ready"})
    for line in requests:
        try:
            request = json.loads(line)
        except ValueError:
            continue
        rid = request.get("id")
        try:
            send({"id": rid, "ok": True, "result": planner.answer(request, send)})
        except (UserError, ValueError, TypeError, OSError) as e:
            send({"id": rid, "ok": False, "error": str(e)})
        except Exception as e:  # noqa: BLE001 - the wizard shows it; the traceback goes to the log
            traceback.print_exc()
            send({"id": rid, "ok": False, "error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    answers, sys.stdout = sys.stdout, sys.stderr  # only answers go to the real stdout
    serve(sys.stdin, answers)
