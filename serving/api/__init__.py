"""The request and response schema shared by the frontends: OpenAI's Chat Completions and Completions requests
(`protocol`: pydantic models, their mapping onto one engine request, OpenAI error bodies) and responses (`responses`:
bodies and Server-Sent Event chunks). Imports neither serving.core nor a server, so the gateway can use it too."""
