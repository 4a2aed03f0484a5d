"""Decapybara on Ray Serve.

    serve run serve_app:app                                   # the embedded demo model, defaults
    serve run serve_app:build_app model=/path/m.mcapy slots=8 kv_mode=6/6 api_key=secret

`build_app` validates its arguments with `decapybara.server.config.AppConfig` (unknown keys are an error).
"""

from __future__ import annotations

from decapybara.server.ingress import build_app

app = build_app({})

__all__ = ["app", "build_app"]
