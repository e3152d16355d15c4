"""How a choice's calls and deltas travel between the ingress and the engine replicas: Serve
handle calls and streams (`serve_calls`, `call_deltas`), and the delta channel (replica ->
ingress, one msgpack frame per engine step over an authenticated TCP connection: `delta_wire`,
`delta_codec`, `delta_auth`, `delta_inbox`, `delta_queue`, `delta_outbox`;
docs/serving.md "Transport")."""
