"""An OpenAI-compatible endpoint in front of masrl's rollout engine (``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``): programs written against the OpenAI API run as a team's episodes,
and every call they make is a recorded turn of the agent their ``model`` field names. See docs/gateway.md."""
from masrl.gateway.errors import GatewayError
from masrl.gateway.server import EpisodeSession, Gateway, GatewayLimits

__all__ = ["EpisodeSession", "Gateway", "GatewayError", "GatewayLimits"]
