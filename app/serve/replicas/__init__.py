"""The Serve deployments that own an engine: `PrefillServer` (prefill, KV published to the
store, the result handed off), `DecodeServer` (the hand-off taken, decode), `EngineServer`
(both, colocated), what they share (`engine_replica`: construction, health, reported load;
`replica`: the engine host, store access, stats) and tensor-parallel ranks (`tp_workers`)."""
