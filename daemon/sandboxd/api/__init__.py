"""The only package that speaks gRPC: servicers that translate, the error and limit interceptors, authentication and the peer-credential relay."""
