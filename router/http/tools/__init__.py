"""Tool calls in the OpenAI chat API: the request's `tools` and `tool_choice`, and the parsers
that read the model's calls back, one per chat-template family (router/README.md)."""
