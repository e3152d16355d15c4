"""The gRPC API (`slimserve.v1.Generation`, served by the Ingress replicas): the servicer, the
conversion of protos to and from the shared request model (app/serve/api), structured
outputs over gRPC, the servicer's registration with Ray Serve, and the generated code
(`grpc_gen`, made from protos/ by `make protos`)."""
