"""The Serve deployments that own an engine: `PrefillServer` (prefill, KV published to the
store, the result handed off), `DecodeServer` (the hand-off taken, decode), `EngineServer`
(both, colocated), what they share (`engine_replica`: construction, health, reported load;
`replica`: the engine host, store access, stats), the decode side of an overlapped hand-off
(`hand_off_parts`) and tensor-parallel ranks (`tp_workers`)."""
