"""The request path's logic that the gateway and the engines share: tokenising, admission,
coalescing, vectors, scorers, pairs and the trace hooks. No HTTP; it imports only the contracts
and the config layer."""
