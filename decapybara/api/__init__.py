"""The HTTP API layer: OpenAI- and Anthropic-compatible routes over an abstract async `EngineClient`.

`create_app(client)` builds the FastAPI app; `LocalEngineClient(engine)` runs an in-process `Engine` in a
background thread. No Ray here: the Serve deployment wraps the app with its own client.
"""

from decapybara.api.app import create_app
from decapybara.api.client import EngineClient, LocalEngineClient

__all__ = ["EngineClient", "LocalEngineClient", "create_app"]
