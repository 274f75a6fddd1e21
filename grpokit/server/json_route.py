"""Request bodies parsed as JSON within bounds on every FastAPI surface (``BoundedJsonRoute``).

FastAPI reads a body with ``json.loads``, which takes an object naming one key twice (the last one wins, so two
readers of one body can disagree on what it asked) and answers a number past Python's 4,300-digit limit with a
generic "error parsing the body". Routes built with ``BoundedJsonRoute`` parse with ``grpokit.wire.json_text``'s
hooks instead: a repeated key or an over-long number is a 400 naming it. The nesting was measured by the guard already
(server/guard.py); ``NaN`` and lone surrogates go on to the schema, whose 422 names the field.
"""

from __future__ import annotations

import json

from fastapi import HTTPException, Request
from fastapi.routing import APIRoute

from grpokit.wire.json_text import JsonTextError, bounded_number, unique_pairs

MAX_BODY_NUMBER_CHARS = 100  # a float's 17 significant digits and exponent; a seed or a count fits easily


class BoundedJsonRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            try:  # text that is no JSON raises JSONDecodeError: FastAPI's own 422 (json_invalid) answers it
                self._json = json.loads(
                    body,
                    parse_int=bounded_number(int, MAX_BODY_NUMBER_CHARS, False),
                    parse_float=bounded_number(float, MAX_BODY_NUMBER_CHARS, False),
                    object_pairs_hook=unique_pairs,
                )
            except JsonTextError as e:
                raise HTTPException(400, f"the body: {e}; send JSON without it") from None
            except UnicodeDecodeError as e:
                raise HTTPException(400, f"the body is not UTF-8 text (byte {e.start}); send UTF-8 JSON") from None
        return self._json


class BoundedJsonRoute(APIRoute):
    """An APIRoute whose handler reads the body with ``BoundedJsonRequest``."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def bounded(request: Request):
            return await handler(BoundedJsonRequest(request.scope, request.receive))

        return bounded
