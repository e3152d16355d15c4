"""The request model both APIs share: the OpenAI-compatible HTTP request and response
models (`openai_protocol`), their parsing and limits (`http_input`, `openapi_schema`), the
one normalisation both the HTTP and the gRPC adapter go through (`normalize`: model name,
tenant salt, tokens, limits, sampling parameters), structured outputs and tool calls, and the
answers made from engine deltas (`responses`: SSE chunks, JSON bodies, errors)."""
