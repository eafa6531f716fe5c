"""The router's HTTP side: the OpenAI-compatible API, /health and /metrics (FastAPI +
uvicorn in the router's event loop). See router/README.md."""
