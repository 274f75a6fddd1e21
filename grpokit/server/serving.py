"""`grpokit rollout` once its options are sound: the engine's state, the app, and the transport until interrupted.

Apart from ``server/cli.py`` because this side loads torch, transformers and the web stack, which parsing the options
(and ``grpokit rollout --help``) must not.
"""

from __future__ import annotations

import sys

from grpokit.server.app import create_app
from grpokit.server.options import ServerOptions
from grpokit.server.state import build_state
from grpokit.server.transport import connection_cap, serve


def serve_rollouts(options: ServerOptions) -> None:
    """Load the model, say where it serves, and serve until interrupted."""
    state = build_state(options)
    app = create_app(state)
    auth = "API key required" if options.api_key else "no API key"
    turns = f", multi-turn: {options.multi_turn_scheduler}" if options.multi_turn_scheduler else ""
    print(
        f"grpokit rollout: serving {options.model} ({options.engine}{turns}) on "
        f"http://{options.host}:{options.port} ({auth})",
        file=sys.stderr,
        flush=True,
    )
    serve(app, options.host, options.port, options.transport_limits(connection_cap(options.max_connections)))
