"""How every gRPC server of the agent is made: grpc.aio on the agent's event loop, through grpcio's public API
only, with explicit limits. The device plugin's servers (deviceplugin/server.py) and the DRA kubelet plugin's
(dra/plugin.py) are made here; each names the largest request it takes."""

from __future__ import annotations

import grpc

KEEPALIVE_TIME_MS = 60_000
"""A connection with nothing received for this long is pinged; a client that does not answer within
KEEPALIVE_TIMEOUT_MS is gone, and its calls (a ListAndWatch or health stream) end."""
KEEPALIVE_TIMEOUT_MS = 20_000
MIN_CLIENT_PING_MS = 10_000
"""A client may ping this often (the kubelet's grpc-go sends none by default); more often, after
MAX_PING_STRIKES pings, its connection is closed with GOAWAY."""
MAX_PING_STRIKES = 2
MAX_CONNECTION_STREAMS = 1024
"""Calls (HTTP/2 streams) one client connection may have open at once: the kubelet uses a few; a client that
opens more has the excess refused (REFUSED_STREAM, which gRPC clients report as UNAVAILABLE)."""
MAX_CONCURRENT_CALLS = 4096
"""Calls one server runs at once, all connections together; one beyond is refused with RESOURCE_EXHAUSTED."""
MAX_SEND_BYTES = 64 * 1024 * 1024
"""An answer grows with the devices it names; this only stops a runaway."""


def server_options(max_receive_bytes: int) -> list[tuple[str, int]]:
    """The channel arguments of a server that takes requests up to `max_receive_bytes`."""
    return [
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", MAX_SEND_BYTES),
        ("grpc.max_concurrent_streams", MAX_CONNECTION_STREAMS),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_CLIENT_PING_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_MS),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
    ]


def aio_server(max_receive_bytes: int) -> grpc.aio.Server:
    """A grpc.aio server on the running event loop with the agent's limits; a request over `max_receive_bytes`
    is refused with RESOURCE_EXHAUSTED before it is parsed."""
    return grpc.aio.server(options=server_options(max_receive_bytes), maximum_concurrent_rpcs=MAX_CONCURRENT_CALLS)
