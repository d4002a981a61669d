@echo off
rem MoE Studio on Windows: NOT QUALIFIED (never run on native Windows by the project); the steps
rem are in packaging\README.md, "Windows". Without arguments it opens the desktop app with
rem pythonw (no console window); with arguments it is the `moestudio` command line.
setlocal
set "ROOT=%~dp0..\.."
if not exist "%ROOT%\.venv\Scripts\pythonw.exe" (
    echo MoE Studio: no venv at "%ROOT%\.venv"; follow packaging\README.md, "Windows", first. 1>&2
    exit /b 1
)
if "%~1"=="" (
    start "" "%ROOT%\.venv\Scripts\pythonw.exe" -m engine.cli
) else (
    "%ROOT%\.venv\Scripts\python.exe" -m engine.cli %*
)
