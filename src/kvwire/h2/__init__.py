"""HTTP/2 for gRPC, as much as Envoy's gRPC clients use: the frame codec (:mod:`.frames`),
the pure server connection machine (:mod:`.connection`: settings, ping, flow control both
ways), HPACK decoding (:mod:`.hpack_decoder`, on the ``hpack`` package's tables) and a gRPC
server on asyncio around them (:mod:`.grpc`). The endpoint picker serves Envoy's ext_proc
streams on it: per stream it costs a fraction of grpc.aio's CPU."""
