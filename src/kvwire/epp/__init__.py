"""kvwire as the endpoint picker of a gateway (Envoy's ``ext_proc``, the Gateway API
Inference Extension's protocol): Envoy carries the requests, kvwire decides where each one
goes (``kvwire epp``, docs/epp.md). :mod:`.machine` is the pure per-stream protocol,
:mod:`.messages` its protobuf, :mod:`.picker` the decision (the proxy's fleet and tokens, the
routing core), :mod:`.service` the gRPC servicer, :mod:`.bootstrap` the Envoy config."""
