"""The Envoy bootstrap ``kvwire epp --envoy-config`` prints: one listener whose requests go
through the ``ext_proc`` filter to kvwire epp and then to the engine it picked, by an
ORIGINAL_DST cluster that reads the ``x-gateway-destination-endpoint`` header. The filter's
modes are those of the Gateway API Inference Extension's chart by default (request and
response bodies ``FULL_DUPLEX_STREAMED``, headers and trailers sent); YAML with comments,
written as text (Envoy reads YAML; no YAML library needed to write it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BODY_MODES", "EnvoyConfig", "bootstrap"]

#: The body modes the filter may be given (Envoy's names). For a request, STREAMED cannot
#: carry the pick; for an answer, BUFFERED holds a streamed answer until its end.
BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED", "STREAMED", "NONE")


@dataclass(frozen=True)
class EnvoyConfig:
    """What the bootstrap says: where Envoy listens, where kvwire epp's gRPC is, the
    filter's body modes."""

    listen_host: str = "0.0.0.0"
    listen_port: int = 8081
    admin_host: str = "127.0.0.1"
    admin_port: int = 19000
    epp_host: str = "127.0.0.1"
    epp_port: int = 9002
    #: more pickers beside it, (host, port) each: Envoy spreads the requests' streams over
    #: them (least requests)
    more_pickers: tuple[tuple[str, int], ...] = ()
    request_body_mode: str = "FULL_DUPLEX_STREAMED"
    response_body_mode: str = "FULL_DUPLEX_STREAMED"
    #: seconds Envoy waits for each answer of the picker before failing the request
    message_timeout: float = 30.0
    #: the engines' answers: a stream may last long (0 would mean no limit at all)
    route_timeout: float = 3600.0
    #: with a BUFFERED request body, Envoy holds the whole body within its connection buffer
    #: limit (1 MiB by default, past which it answers 500 itself): raised to kvwire epp's
    #: --max-body
    buffer_limit: int = 32 << 20
    #: the picker serves gRPC over TLS with this certificate (PEM), which Envoy then trusts
    #: (a self-signed one is its own authority); None: plaintext
    tls_ca: str | None = None


def _mode(name: str, which: str) -> str:
    if name not in BODY_MODES:
        raise ValueError(f"{which} must be one of {', '.join(BODY_MODES)}, got {name!r}")
    return name


def bootstrap(c: EnvoyConfig) -> str:
    """The bootstrap YAML for ``c``."""
    req = _mode(c.request_body_mode, "the request body mode")
    resp = _mode(c.response_body_mode, "the response body mode")
    if req not in ("FULL_DUPLEX_STREAMED", "BUFFERED"):
        raise ValueError(f"the request body mode {req} cannot carry a pick made from the "
                         "prompt: FULL_DUPLEX_STREAMED or BUFFERED")
    # FULL_DUPLEX_STREAMED needs the trailers sent (they can end a body); elsewhere too, so
    # the picker sees where a request or an answer ends
    limit = (f"\n    per_connection_buffer_limit_bytes: {c.buffer_limit}  # (BUFFERED: "
             "the whole body is held)" if "BUFFERED" in (req, resp) else "")
    tls = "" if c.tls_ca is None else f"""
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          alpn_protocols: [h2]
          validation_context:
            trusted_ca: {{filename: "{c.tls_ca}"}}"""
    hc_tls = "" if c.tls_ca is None else """
      tls_options: {alpn_protocols: [h2]}"""
    # FULL_DUPLEX_STREAMED: Envoy drops the request's content-length even where the picker
    # sets it; the picker also sends it as x-kvwire-content-length, made content-length
    # again here (so the engine gets the body with its length, not chunked)
    restore = "" if req != "FULL_DUPLEX_STREAMED" else """
          # The request body's length, which Envoy drops in FULL_DUPLEX_STREAMED: the picker
          # sends it as x-kvwire-content-length (absent: nothing is set).
          - name: envoy.filters.http.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
              mutations:
                request_mutations:
                - append:
                    header: {key: content-length, value: "%REQ(x-kvwire-content-length)%"}
                    append_action: OVERWRITE_IF_EXISTS_OR_ADD
                    keep_empty_value: false
                - remove: x-kvwire-content-length"""
    pickers = "".join(f"""
        - endpoint:
            address:
              socket_address: {{address: {h}, port_value: {p}}}"""
                      for h, p in ((c.epp_host, c.epp_port), *c.more_pickers))
    return f"""\
# Envoy in front of the engines, kvwire epp picking the engine of each request.
# Written by `kvwire epp --envoy-config`; run it with `envoy -c FILE`.
admin:
  address:
    socket_address: {{address: {c.admin_host}, port_value: {c.admin_port}}}
static_resources:
  listeners:
  - name: inference
    address:
      socket_address: {{address: {c.listen_host}, port_value: {c.listen_port}}}{limit}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: inference
          route_config:
            name: inference
            virtual_hosts:
            - name: engines
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: picked_engine
                  timeout: {c.route_timeout:g}s
                  idle_timeout: {c.route_timeout:g}s
                # The engine that served the answer, as metadata for the picker (below).
                response_headers_to_add:
                - header: {{key: x-gateway-destination-endpoint-served, value: "%UPSTREAM_REMOTE_ADDRESS%"}}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{cluster_name: kvwire_epp}}
              # Fail closed (the default, as in the Inference Extension's chart): with the
              # picker down every request gets an immediate 5xx. failure_mode_allow: true
              # would send them on without a pick, which this route cannot serve (the
              # ORIGINAL_DST cluster needs the header): it also needs a fallback route.
              failure_mode_allow: false
              message_timeout: {c.message_timeout:g}s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: {req}
                response_body_mode: {resp}
                request_trailer_mode: SEND
                response_trailer_mode: SEND
              # The pick also comes as dynamic metadata under envoy.lb; Envoy keeps what an
              # ext_proc server sends only in the namespaces listed here.
              metadata_options:
                receiving_namespaces:
                  untyped: [envoy.lb]
                forwarding_namespaces:
                  untyped: [envoy.lb]
          # The served engine's address (the route's answer header) as envoy.lb metadata,
          # which the ext_proc filter forwards with the answer's headers.
          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              response_rules:
              - header: x-gateway-destination-endpoint-served
                on_header_present:
                  metadata_namespace: envoy.lb
                  key: x-gateway-destination-endpoint-served
                  type: STRING
                remove: true{restore}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
              suppress_envoy_headers: true
  clusters:
  # The engine kvwire epp picked: the address in the x-gateway-destination-endpoint
  # header (exactly one IP:PORT).
  - name: picked_engine
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 5s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
    circuit_breakers:
      thresholds:
      - {{max_connections: 40000, max_pending_requests: 40000, max_requests: 40000}}
  # kvwire epp's gRPC port (HTTP/2), health-checked with gRPC health as the chart does.
  - name: kvwire_epp
    type: STATIC
    lb_policy: LEAST_REQUEST
    connect_timeout: 5s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
    circuit_breakers:
      thresholds:
      - {{max_connections: 40000, max_pending_requests: 40000, max_requests: 40000}}
    health_checks:
    - timeout: 2s
      interval: 5s
      unhealthy_threshold: 3
      healthy_threshold: 1
      grpc_health_check:
        service_name: envoy.service.ext_proc.v3.ExternalProcessor{hc_tls}{tls}
    load_assignment:
      cluster_name: kvwire_epp
      endpoints:
      - lb_endpoints:{pickers}
"""
